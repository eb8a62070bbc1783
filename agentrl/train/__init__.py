"""What trains: finished samples → packed rows → chunked logprobs → loss → optimizer step → checkpoint.

The trainer consumes `agentrl.sample.TrainingSample`s and nothing else: this package imports neither the engine,
the rollout driver, the environments nor the chat layer (`agentrl.run` wires them together). Exports are lazy so
that `agentrl.train.config` (no torch) can validate a config before anything heavy loads.
"""

from agentrl.lazy import lazy_exports

_EXPORTS = {
    "Trainer": "trainer",
    "PackedBatch": "pack", "TrainableTokens": "pack", "pack_samples": "pack", "first_fit_decreasing": "pack",
    "packed_hidden_states": "logprobs", "packed_token_logprobs": "logprobs", "chunked_logprobs": "lm_head",
    "packing_error": "logprobs", "is_hybrid": "logprobs",
    "policy_loss": "loss", "loss_denominator": "loss",
    "build_optimizer": "optim", "build_scheduler": "optim", "should_skip": "optim", "Stepper": "optim",
    "save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint", "latest_checkpoint": "checkpoint",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
