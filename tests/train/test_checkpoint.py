"""The optimizer step and resuming it: schedule, skip-and-count, bit-exact resume, atomic saves."""

import random

import pytest
import torch

from agentrl.models import load_model
from agentrl.train import checkpoint as ckpt
from agentrl.train.config import LossConfig, OptimConfig
from agentrl.train.logprobs import packed_token_logprobs
from agentrl.train.loss import policy_loss
from agentrl.train.optim import Stepper, WarmupCosine, build_optimizer, build_scheduler, should_skip
from agentrl.train.pack import pack_samples
from agentrl.sample import TrainingSample

OPTIM = OptimConfig(lr=1e-3, weight_decay=0.01, warmup_steps=1)
LOSS = LossConfig(type="dapo", clip_eps_high=0.28, tis_cap=2.0)
TOTAL_STEPS = 4


def _samples(vocab=320, n=8):
    g = torch.Generator().manual_seed(7)
    out = []
    for k in range(n):
        length = 6 + 3 * k
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        trainable = [0, 0, 0] + [1] * (length - 3)
        behaviour = [(-2.0 - 0.1 * i) * t for i, t in enumerate(trainable)]
        out.append(TrainingSample(ids, trainable, behaviour, [0 if t else -1 for t in trainable],
                               advantage=(-1.0) ** k * (1 + 0.25 * k)))
    return out


def _setup(seed):
    model, _ = load_model("tiny-qwen3", seed=seed)
    model.train()
    optimizer = build_optimizer(model, OPTIM)
    scheduler = build_scheduler(optimizer, OPTIM, TOTAL_STEPS)
    return model, optimizer, scheduler, Stepper(model, optimizer, scheduler, OPTIM)


def _train(model, stepper, samples, steps, start):
    for step in range(start, start + steps):
        pick = torch.randperm(len(samples))[:4].tolist()  # draws from torch's RNG: resume must restore it
        random.shuffle(pick)  # and from python's
        batch = pack_samples([samples[i] for i in pick], row_tokens=48)
        logprobs, entropy = packed_token_logprobs(model, batch, chunk_size=16)
        loss, _ = policy_loss(logprobs, batch.trainable_tokens(), LOSS, current_version=step, entropy=entropy)
        loss.backward()
        assert not stepper.step(loss).skipped


@pytest.fixture
def deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


def test_resume_is_bit_identical(tmp_path, deterministic):
    samples = _samples()

    torch.manual_seed(123)
    random.seed(123)
    straight, _, _, stepper = _setup(seed=0)
    _train(straight, stepper, samples, 4, start=0)

    torch.manual_seed(123)
    random.seed(123)
    first, opt, sched, stepper = _setup(seed=0)
    _train(first, stepper, samples, 2, start=0)
    path = ckpt.save_checkpoint(tmp_path, 2, first, opt, sched, extra={"step": 2, "prompt_position": 17})
    del first, opt, sched, stepper

    torch.manual_seed(999)  # whatever the fresh process's RNG holds must not matter
    random.seed(999)
    resumed, opt, sched, stepper = _setup(seed=1)  # different init: the weights must come from the checkpoint
    assert ckpt.latest_checkpoint(tmp_path) == path
    state = ckpt.load_checkpoint(path, resumed, opt, sched)
    assert state == {"step": 2, "extra": {"step": 2, "prompt_position": 17}}
    _train(resumed, stepper, samples, 2, start=2)

    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name
    assert sched.last_epoch == 4


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt, sched, _ = _setup(seed=0)
    good = ckpt.save_checkpoint(tmp_path, 1, model, opt, sched, extra={"step": 1})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    real_save, calls = torch.save, []

    def dying_save(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            f.write(b"half a file")
            raise OSError("disk full")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dying_save)
    for step in (2, 1):  # a new step, and overwriting the existing one
        calls.clear()
        with pytest.raises(OSError, match="disk full"):
            ckpt.save_checkpoint(tmp_path, step, model, opt, sched, extra={"step": step})
    monkeypatch.undo()

    assert ckpt.list_checkpoints(tmp_path) == [good]
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name]  # no temporary left behind
    fresh, _, _, _ = _setup(seed=3)
    assert ckpt.load_checkpoint(good, fresh)["extra"] == {"step": 1}
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_keep_last_and_resave(tmp_path):
    model = torch.nn.Linear(2, 2)
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, model, keep_last=2, extra={"v": step})
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    ckpt.save_checkpoint(tmp_path, 3, model, keep_last=2, extra={"v": 33})
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path), model)["extra"] == {"v": 33}
    (tmp_path / "step_00000009").mkdir()  # incomplete directory (no files): never "latest"
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000003"
    assert ckpt.latest_checkpoint(tmp_path / "missing") is None


def test_warmup_cosine_schedule():
    f = WarmupCosine(warmup_steps=2, total_steps=6, min_ratio=0.1)
    assert [f(s) for s in (0, 1, 2, 4, 6, 9)] == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.1, 0.1])


def test_optimizer_groups_and_non_finite_steps_are_skipped_and_counted():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    cfg = OptimConfig(lr=0.1, weight_decay=0.5, max_grad_norm=1.0, max_consecutive_skips=2)
    opt = build_optimizer(model, cfg)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    assert [len(g["params"]) for g in opt.param_groups] == [1, 3]  # only the matrix decays
    assert not opt.defaults.get("fused")  # fused AdamW is for CUDA parameters
    sched = build_scheduler(opt, cfg, total_steps=10)
    stepper = Stepper(model, opt, sched, cfg)

    assert should_skip(torch.tensor(float("nan")), 1.0) and should_skip(1.0, float("inf"))
    assert not should_skip(torch.tensor(2.0), torch.tensor(3.0))

    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.ones(1, 3)).sum() * float("inf")
    loss.backward()
    result = stepper.step(loss)
    assert result.skipped and stepper.skipped_total == 1 and sched.last_epoch == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())

    loss = (model(torch.ones(1, 3)) * torch.tensor([1.0, 2.0, 3.0])).sum()
    loss.backward()
    result = stepper.step(loss)
    assert not result.skipped and stepper.skipped_in_a_row == 0 and sched.last_epoch == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    def bad_step():
        bad = model(torch.ones(1, 3)).sum() * float("nan")
        bad.backward()
        return stepper.step(bad)

    assert bad_step().skipped
    with pytest.raises(RuntimeError, match="2 steps in a row"):  # max_consecutive_skips: the run is broken
        bad_step()


def test_a_fused_optimizer_skips_on_the_device_exactly_as_the_host_decides(monkeypatch):
    """A fused AdamW (the CUDA default) skips a non-finite step in its own kernel, with nothing read back before the
    update: weights, moments, step counts, schedule and skip counts equal a stepper whose host decides first, bit
    for bit, over finite, non-finite and finite steps; and the run still stops after too many skips in a row."""
    cfg = OptimConfig(lr=0.1, weight_decay=0.5, max_grad_norm=1.0, max_consecutive_skips=2)

    def stepper():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
        return Stepper(model, opt, build_scheduler(opt, cfg, total_steps=10), cfg)

    on_device, on_host = stepper(), stepper()
    monkeypatch.setattr(type(on_host), "skips_on_device", property(lambda self: self.optimizer is not on_host.optimizer))
    assert on_device.skips_on_device and not on_host.skips_on_device

    def step(s, scale):
        loss = (s.model(torch.ones(1, 3)) * torch.tensor([1.0, 2.0, 3.0])).sum() * scale
        loss.backward()
        return s.step(loss.detach())

    for scale in (1.0, float("nan"), 2.0, float("inf")):
        a, b = step(on_device, scale), step(on_host, scale)
        assert (a.skipped, a.lr) == (b.skipped, b.lr) and a.skipped == (scale != scale or scale == float("inf"))
        assert a.grad_norm == b.grad_norm or (a.grad_norm != a.grad_norm and b.grad_norm != b.grad_norm)
        assert all(torch.equal(x, y) for x, y in zip(on_device.model.parameters(), on_host.model.parameters()))
        for x, y in zip(on_device.model.parameters(), on_host.model.parameters()):
            sx, sy = on_device.optimizer.state[x], on_host.optimizer.state[y]
            assert all(torch.equal(sx[k], sy[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
        assert (on_device.scheduler.last_epoch, on_device.skipped_total) == (on_host.scheduler.last_epoch,
                                                                             on_host.skipped_total)
    assert on_device.scheduler.last_epoch == 2 and on_device.skipped_total == 2
    assert float(on_device.optimizer.state[next(on_device.model.parameters())]["step"]) == 2
    with pytest.raises(RuntimeError, match="2 steps in a row"):
        step(on_device, float("nan"))
        step(on_device, float("nan"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_parameters_get_fused_adamw_and_resume_with_cuda_rng(tmp_path):
    model = torch.nn.Linear(4, 4).cuda()
    opt = build_optimizer(model, OPTIM)
    assert opt.defaults["fused"] is True
    model(torch.ones(2, 4, device="cuda")).sum().backward()
    opt.step()
    path = ckpt.save_checkpoint(tmp_path, 1, model, opt)
    expected = torch.rand(3, device="cuda")  # drawn after the save: a restore must replay it
    fresh = torch.nn.Linear(4, 4).cuda()
    fresh_opt = build_optimizer(fresh, OPTIM)
    ckpt.load_checkpoint(path, fresh, fresh_opt, map_location="cuda")
    assert torch.equal(torch.rand(3, device="cuda"), expected)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    assert fresh_opt.state_dict()["state"][0]["exp_avg"].is_cuda
