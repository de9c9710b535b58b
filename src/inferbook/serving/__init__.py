"""Serving: a small decoder-only model, its generation loop, the engine and the KV tiers
(the chapters that measure them live in `inferbook.chapters`)."""
