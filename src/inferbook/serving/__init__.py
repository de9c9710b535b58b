"""Serving: a small decoder-only model, its generation loop, and the chapters measured on it."""
