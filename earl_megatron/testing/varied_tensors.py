"""A test table with a TensorSpec of each kind (bool, per-sample, first+last pp_stage) that the
trainer's runtime/step_inputs.TRAIN_TENSORS does not all reach. Pure: no torch."""

from earl_megatron.plan.placement import TensorSpec

VARIED_TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec("tokens", "int64", True, "first+last"),
    TensorSpec("loss_mask", "bool", True, "last"),
    TensorSpec("old_logprobs", "float32", True, "last"),
    TensorSpec("ref_logprobs", "float32", True, "last"),
    TensorSpec("advantages", "float32", True, "last"),
    TensorSpec("rewards", "float32", False, "last"),
)
