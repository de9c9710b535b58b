"""Workflows in the ComfyUI API format: an executor with a cache, generic loops, reference rules.

    executor.py    registry, validation, one queue, output cache keyed by class + inputs + ancestors
                   (output nodes cached as in ComfyUI), bounds (64-bit ints, JSON depth, iteration caps)
    loops.py       StartLoop / EndLoop as in ComfyUI: simple, For and List modes, output_value /
                   next_iteration_value / accumulate / terminations, projected into ordinary nodes
    references.py  validate_references (every Ref2VA rule by name), check_service_mapping (endpoint, model, LoRA)
    omni_server.py a toy in-process server for the H3 workflows (owns text encoding, denoising, both VAEs)
    nodes.py       the node classes our workflows use
    segments.py    the loop chapter's toy segment generator and its continuity measurements
    cli.py         `inferbook workflow run FILE.json`
"""
from __future__ import annotations

from .executor import REGISTRY, Executor, describe_inputs, RunResult, WorkflowError, load_workflow, parse_workflow, run_workflow, validate
from . import loops, nodes  # noqa: F401,E402  (register node classes)
from .references import check_service_mapping, validate_references

__all__ = ["REGISTRY", "Executor", "RunResult", "WorkflowError", "check_service_mapping", "load_workflow",
           "parse_workflow", "run_workflow", "validate", "validate_references"]
