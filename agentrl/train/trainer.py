"""One training step over finished samples: pack → micro-batches → chunked logprobs → loss → backward → update.

The trainer knows samples and parameters, nothing of where the samples came from. Whoever owns a generator
reading the same parameters passes `guard`: the optimizer step and what must follow it (a policy version bump)
run inside it, so no decode step sees half the parameters updated.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Callable, ContextManager, Sequence

import torch

from agentrl.sample import TrainingSample
from agentrl.train.config import LossConfig, OptimConfig, TrainerConfig
from agentrl.train.flat_graphs import FlatGraphs
from agentrl.train.logprobs import _decoder, is_hybrid, packed_token_logprobs
from agentrl.train.loss import TokenLoss, carries_gradient, samples_loss_denominator
from agentrl.train.micro_batch import default_rows_per_micro_batch
from agentrl.train.optim import Stepper, build_optimizer, build_scheduler
from agentrl.train.pack import pack_samples
from agentrl.train.prefix_forward import prefix_sharing_error, prefix_sharing_unsupported, shared_token_logprobs
from agentrl.train.prefix_pack import SharedBatch, groups_of, pack_shared, plan_units, prefix_tree_tokens
from agentrl.train.varlen_attention import takes_flat_layout

# A tree mask read wrongly changes hidden states by O(1); rounding (bf16 included) stays far below this.
_TREE_ERROR_LIMIT = 0.05
_TREE_CHECK_ATTEMPTS = 3  # steps that check prefix sharing while the check raises, before it is turned off


class Trainer:
    def __init__(self, model: torch.nn.Module, config: TrainerConfig, loss: LossConfig, optim: OptimConfig, *,
                 total_steps: int, temperature: float = 1.0, hybrid_varlen: bool = False, pad_token_id: int = 0,
                 cuda_graphs: bool = False, capture_guard: Callable[[], ContextManager] = contextlib.nullcontext):
        """`cuda_graphs`: replay the flat forward and backward from CUDA graphs (`flat_graphs`; the run resolves
        `trainer.cuda_graphs`); `capture_guard` holds every other GPU user off while one is captured."""
        self.model, self.config, self.loss_config = model, config, loss
        self.temperature, self.hybrid_varlen, self.pad_token_id = temperature, hybrid_varlen, pad_token_id
        self.device = next(model.parameters()).device
        # On GPU, rows (or the flat layout's length) round up to a multiple: fewer shapes for compiled kernels.
        self.pad_multiple = config.row_pad_multiple if self.device.type == "cuda" else 1
        self.rows_per_micro_batch = (config.rows_per_micro_batch
                                     or default_rows_per_micro_batch(model, config.row_tokens))
        self.optimizer = build_optimizer(model, optim)
        self.scheduler = build_scheduler(self.optimizer, optim, total_steps)
        self.stepper = Stepper(model, self.optimizer, self.scheduler, optim)
        # Prefix sharing where the forward supports it; checked once against unshared packing on the real
        # attention kernel before the first step relies on it.
        self.share_prefix = config.share_prefix and prefix_sharing_unsupported(model) is None
        self._tree_checks_left = _TREE_CHECK_ATTEMPTS
        self.graphs = None
        if cuda_graphs:
            if self.device.type != "cuda" or not takes_flat_layout(model) or (is_hybrid(model) and not hybrid_varlen):
                raise ValueError("trainer.cuda_graphs=true needs CUDA and the varlen attention (a hybrid model its "
                                 f"varlen kernels too; here: {self.device.type}, attention "
                                 f"{model.config._attn_implementation!r})")
            self.graphs = FlatGraphs(_decoder(model), pad_multiple=self.pad_multiple, row_tokens=config.row_tokens,
                                     guard=capture_guard)

    def pack(self, samples: Sequence[TrainingSample]):
        """The step's batch: prefix-shared where enabled and supported, else unshared."""
        share = self.share_prefix
        if share and self._tree_checks_left:
            self._tree_checks_left -= 1
            try:
                error, why = prefix_sharing_error(self.model), None
            except Exception as exc:  # a kernel that cannot run the tree mask here (e.g. fails to compile)
                error, why = float("inf"), f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if why is None:
                self._tree_checks_left = 0  # a measured difference is final, however it came out
            if error > _TREE_ERROR_LIMIT:
                share = False
                found = f"failed ({why})" if why else f"differs from unshared packing (relative error {error:.3g})"
                if self._tree_checks_left:  # a failure may be passing (a kernel tuning in another thread): retry
                    warnings.warn(f"prefix-shared forward {found} on this model and attention; this step trains on "
                                  f"unshared packing, and the next one checks again", stacklevel=2)
                else:
                    self.share_prefix = False
                    warnings.warn(f"prefix-shared forward {found} on this model and attention; training on "
                                  f"unshared packing", stacklevel=2)
        cfg = self.config
        units = plan_units(samples, cfg.row_tokens) if share else []
        if any(len(unit.members) > 1 for unit in units):
            return pack_shared(samples, cfg.row_tokens, pad_token_id=self.pad_token_id,
                               pad_to_multiple=self.pad_multiple, units=units)
        # Groups that share nothing (no group ids, or members that differ from their first token) take the plain
        # packed forward: the tree-mask path would compute the same tokens with more work around them.
        return pack_samples(samples, cfg.row_tokens, pad_token_id=self.pad_token_id, pad_to_multiple=self.pad_multiple)

    def step(self, samples: Sequence[TrainingSample], policy_version: int,
             guard: Callable[[], ContextManager] = contextlib.nullcontext) -> dict:
        """Train on `samples` (generated up to `policy_version`); returns the step's metrics."""
        cfg = self.config
        if not samples:
            raise ValueError("Trainer.step needs at least one sample")
        # Everything a micro-batch needs is built on the host and copied without blocking; the only waits on the
        # device come after the last backward (the loss and the metrics).
        packing = time.perf_counter()
        trained = self.samples_to_train(samples)
        if len(trained) < len(samples):  # packing checks the others (a rollout is built token by token)
            kept = {id(s) for s in trained}
            for sample in samples:
                if id(sample) not in kept:
                    sample.validate()
        if not trained:
            return self._zero_gradient_step(samples, guard)
        batch = self.pack(trained)
        # Over every sample, the left-out ones included: the update is the one over the whole batch.
        denominator = samples_loss_denominator(samples, self.loss_config, policy_version)
        pack_seconds = time.perf_counter() - packing
        graph_counts = dict(self.graphs.counts) if self.graphs is not None else {}
        started = time.perf_counter()
        loss_sum, pending = 0.0, []
        n_rows = batch.input_ids.shape[0]
        for first in range(0, n_rows, self.rows_per_micro_batch):
            host_micro = batch.select_rows(first, min(first + self.rows_per_micro_batch, n_rows))
            micro = host_micro.to(self.device)
            # The loss's gradient is taken inside the lm_head's forward, chunk by chunk (`chunked_logprobs`).
            terms = TokenLoss(host_micro.trainable_tokens(), self.loss_config, current_version=policy_version,
                              denominator=denominator, device=self.device)
            # Under the temperature the generator sampled with: the behaviour logprobs are of logits / T, and the
            # importance ratio must compare like with like.
            forward = shared_token_logprobs if isinstance(micro, SharedBatch) else packed_token_logprobs
            extra = {} if isinstance(micro, SharedBatch) else {"hybrid_varlen": self.hybrid_varlen}
            logprobs, entropy, loss = forward(self.model, micro, chunk_size=cfg.logprob_chunk_size,
                                              pad_multiple=self.pad_multiple, temperature=self.temperature,
                                              graphs=self.graphs, token_loss=terms, **extra)
            metrics = terms.metrics(logprobs, entropy, policy_version)
            loss.backward()
            loss_sum = loss_sum + loss.detach()
            pending.append(metrics)
            # Nothing of this micro-batch's autograd graph may live into the next one's forward: a CUDA graph
            # captured there must create the parameters' gradient accumulators on its own stream (flat_graphs).
            del logprobs, entropy, loss
        # The update is queued behind the last backward before anything is read back: the host's clip and launch
        # work overlaps the device's backward instead of leaving the device idle after a wait.
        with guard():
            update = self.stepper.launch(loss_sum)  # a tensor: at least one micro-batch ran
        result = self.stepper.finish(update)
        loss_total = float(loss_sum)
        metrics_rows = [m.resolve() for m in pending]
        seconds = time.perf_counter() - started
        return {"loss": loss_total, "grad_norm": result.grad_norm, "lr": result.lr, "skipped": result.skipped,
                "train_seconds": seconds, "pack_seconds": pack_seconds, "rows": n_rows,
                **sample_counts(samples, trained, seconds), **token_counts(trained, batch),
                **merge_metrics(metrics_rows),
                **{f"flat_graphs_{k}": self.graphs.counts[k] - v for k, v in graph_counts.items()}}

    def samples_to_train(self, samples: Sequence[TrainingSample]) -> list[TrainingSample]:
        """The samples a step runs forward and backward: those that carry a gradient (`trainer.skip_zero_advantage`),
        or all of them (the option off, or the run's first step: `first_step`). Either gives the same update."""
        if not self.config.skip_zero_advantage or self.first_step:
            return list(samples)
        return [s for s in samples if carries_gradient(s)]

    @property
    def first_step(self) -> bool:
        """No update has run yet: the schedule has not advanced and no step was skipped. The run's first step runs
        every sample, so the trainer's compiles and first captures fall on it, which pays for start-up anyway, and
        not on whichever later step first has a group that scored apart (an untrained model's first groups often all
        score alike). Read from state a checkpoint restores, so a resumed run chooses as the straight run did (and
        trains bit for bit alike), and every replica alike."""
        return self.scheduler.last_epoch == 0 and self.stepper.skipped_total == 0

    def _zero_gradient_step(self, samples: Sequence[TrainingSample], guard) -> dict:
        """A batch in which no sample carries a gradient: no forward, but the update still runs on zero gradients,
        as it would after computing them (AdamW's moments decay and its step advances; a missing gradient would
        leave the parameters out of the update instead)."""
        started = time.perf_counter()
        for p in self.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        with guard():
            result = self.stepper.step(torch.zeros(()))
        seconds = time.perf_counter() - started
        return {"loss": 0.0, "grad_norm": result.grad_norm, "lr": result.lr, "skipped": result.skipped,
                "train_seconds": seconds, "pack_seconds": 0.0, "rows": 0, **sample_counts(samples, [], seconds),
                "computed_tokens": 0, "prefix_shared_tokens": 0, "prefix_tree_shared_tokens": 0}

    def state_dict(self) -> dict:
        return {"stepper": self.stepper.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stepper.load_state_dict(state["stepper"])


def sample_counts(samples: Sequence[TrainingSample], trained: Sequence[TrainingSample], seconds: float) -> dict:
    """`trained_tokens`: the batch's tokens, every sample's (the update is the one over all of them);
    `zero_advantage_samples` / `_tokens`: those left out of the forward as carrying no gradient. No
    `trained_tokens_per_s` for a step that ran no sample: its milliseconds of update would rate it in millions."""
    tokens = sum(len(s) for s in samples)
    left_out = tokens - sum(len(s) for s in trained)
    counts = {"trained_tokens": tokens, "generated_tokens": sum(s.num_trainable for s in samples),
              "zero_advantage_samples": len(samples) - len(trained), "zero_advantage_tokens": left_out}
    if trained:
        counts["trained_tokens_per_s"] = tokens / max(seconds, 1e-9)
    return counts


def token_counts(samples: Sequence[TrainingSample], batch) -> dict:
    """`computed_tokens`: real tokens the forward ran (below `trained_tokens` by what prefix sharing saved,
    `prefix_shared_tokens`); `prefix_tree_shared_tokens`: what sharing a prefix tree per group would save, the
    measure of whether a deeper tree than one common prefix is worth it."""
    trained = sum(len(s) for s in samples)
    tree = sum(prefix_tree_tokens([samples[i].input_ids for i in group]) for group in groups_of(samples))
    return {"computed_tokens": batch.num_tokens, "prefix_shared_tokens": trained - batch.num_tokens,
            "prefix_tree_shared_tokens": trained - tree}


def merge_metrics(rows: list[dict]) -> dict:
    """Token-weighted mean of micro-batch metrics (max / min keep their extreme; histograms add up)."""
    total = sum(r.get("tokens", 0) for r in rows) or 1
    out: dict = {}
    for key in {k for r in rows for k in r}:
        hists = [r[key] for r in rows if isinstance(r.get(key), dict)]
        if hists:
            merged: dict = {}
            for hist in hists:
                for bucket, count in hist.items():
                    merged[str(bucket)] = merged.get(str(bucket), 0) + count
            out[f"loss/{key}"] = dict(sorted(merged.items(), key=lambda kv: int(kv[0])))
            continue
        values = [(r[key], r.get("tokens", 0)) for r in rows if key in r and isinstance(r[key], (int, float))]
        if not values:
            continue
        if key == "tokens":
            out[key] = sum(v for v, _ in values)
        elif key.endswith("max"):
            out[f"loss/{key}"] = max(v for v, _ in values)
        elif key.endswith("min"):
            out[f"loss/{key}"] = min(v for v, _ in values)
        else:
            out[f"loss/{key}"] = sum(v * w for v, w in values) / total
    return out
