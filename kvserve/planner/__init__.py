"""Roofline planner: hardware table, model shapes and a cost model of TTFT, ITL and E2E that counts
bytes as the engine's step metrics do. ``kvserve plan | explain | probe`` are its commands."""
from kvserve.planner.cost import Capacity, Plan, StepCost, Workload, capacity, decode_step, plan, prefill_steps
from kvserve.planner.hardware import HARDWARE, Efficiency, Hardware, efficiency_for, get_hardware
from kvserve.planner.models import MODELS, get_model, shape_from_hf_config
from kvserve.planner.shapes import ModelShape
from kvserve.planner.spec_decode import expected_tokens_per_step, speculative_itl

__all__ = ["Capacity", "Plan", "StepCost", "Workload", "capacity", "decode_step", "plan", "prefill_steps",
           "HARDWARE", "Efficiency", "Hardware", "efficiency_for", "get_hardware", "MODELS", "get_model",
           "shape_from_hf_config", "ModelShape", "expected_tokens_per_step", "speculative_itl"]
