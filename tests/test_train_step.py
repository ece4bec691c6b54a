"""The training step's traffic with the device, checked on the CPU (asr.trainer): one host read per
step, micro-batches staged one ahead with the same results as in line, the next epoch's loader
started before the validation, and a micro-batch cap found for the device kept across a resume."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from host_syncs import HostSyncs
from small_models import small_model

import asr.trainer as trainer
from asr.asr_task import AUDIO, ASRTask
from asr.checkpoint import model_file
from asr.dataset import Batch, WaveBatch
from asr.device_frontend import DeviceFrontend
from asr.distributed import Context
from asr.features import FeatureConfig, SpecAugmentConfig
from asr.train_config import TrainingConfig, plan_batches
from asr.train_log import TrainLog, progress

CPU = Context(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def batch(rows: list[tuple[int, int]], seed: int, ids: str = "u") -> Batch:
    """A Batch of random 16-bin features: one (frames, tokens) pair per utterance."""
    g = torch.Generator().manual_seed(seed)
    frames, tokens = max(f for f, _ in rows), max(n for _, n in rows)
    feats = torch.zeros(len(rows), frames, 16)
    targets = torch.full((len(rows), tokens), -1)
    for i, (f, n) in enumerate(rows):
        feats[i, :f] = torch.randn(f, 16, generator=g)
        targets[i, :n] = torch.randint(2, 12, (n,), generator=g)
    return Batch([f"{ids}{seed}-{i}" for i in range(len(rows))], feats, torch.tensor([f for f, _ in rows]), targets,
                 torch.tensor([n for _, n in rows]))


GROUP = [batch([(60, 5), (44, 3)], 0), batch([(83, 7), (70, 6), (52, 2)], 1), batch([(71, 4)], 2)]


def waves(b: Batch, seed: int) -> WaveBatch:
    """A WaveBatch of the Batch's utterances: random audio of as many 10 ms frames."""
    g = torch.Generator().manual_seed(seed)
    lens = (b.feat_lens - 1) * 160 + 400  # samples of that many frames
    audio = torch.zeros(len(b.ids), int(lens.max()))
    for i, n in enumerate(lens.tolist()):
        audio[i, :n] = 0.1 * torch.randn(n, generator=g)
    return WaveBatch(b.ids, audio, lens, b.tokens, b.token_lens, torch.arange(len(b.ids)) + 10 * seed, 0)


def make_run(exp: Path, *, accum: int = 3, frontend: bool = False, **changes) -> tuple[trainer.Run, ASRTask]:
    torch.manual_seed(0)
    model = small_model().train()
    training = TrainingConfig(warmup_steps=1, lr=1e-3, log_every=1000, checkpoint_every=0, **changes)
    def envelope(m: torch.nn.Module) -> dict:
        return model_file(model={}, frontend={}, tokenizer={}, state_dict=m.state_dict())

    run = trainer.make_run(training, model, exp, CPU, plan_batches(0.0, 10.0, accum, 1), unit=AUDIO,
                           envelope=envelope, final_name="model.pt")
    features = FeatureConfig(n_mels=16)
    device_frontend = DeviceFrontend(features, None, SpecAugmentConfig(time_masks=2)) if frontend else None
    return run, ASRTask(model, None, features, 0.3, CPU.device, frontend=device_frontend)


def step(run: trainer.Run, task: ASRTask, state: trainer.State, group: list) -> None:
    logger = TrainLog(run.exp, False, summarize=task.summarize, unit=AUDIO)
    with progress(False, len(group), 0, "") as bar:
        trainer.train_step(run, state, task, group, logger, bar)


class StepSyncs(HostSyncs):
    """HostSyncs that can be paused: around the task's host-side methods, whose reads are of the
    batches as the loader gave them, in host memory (lengths, dataset keys), never of the device."""

    paused = False

    def _record(self, kind: str) -> None:
        if not self.paused:
            super()._record(kind)

    def pausing(self, method):
        def paused(*args, **kwargs):
            self.paused = True
            try:
                return method(*args, **kwargs)
            finally:
                self.paused = False

        return paused


@pytest.mark.parametrize("inputs", ["features", "waveforms"])
def test_training_step_makes_one_host_sync(inputs, tmp_path, monkeypatch):
    """A step of three micro-batches of the loop's accumulation reads one value back from the
    device: the gradient norm, for the non-finite check. What the task reads on the host (the
    batches' lengths for the loss normalizers and the amount of audio; in `stage` the CTC report and
    the device frontend's keys and lengths) is not counted: on a GPU those tensors are in host memory.
    Counted: `.item()` and its kin, data-sized ops (nonzero, boolean indexing) and `.tolist()` /
    `.cpu()` / `.numpy()`."""
    run, task = make_run(tmp_path, frontend=inputs == "waveforms")
    group = GROUP if inputs == "features" else [waves(b, k) for k, b in enumerate(GROUP)]
    state = trainer.State(total_steps=10)
    syncs = StepSyncs()
    for name in ("counts", "amount", "stage"):
        monkeypatch.setattr(task, name, syncs.pausing(getattr(task, name)))
    step(run, task, state, group)  # the optimizer's state is made at the first step
    with syncs:
        for _ in range(3):
            step(run, task, state, group)
    assert state.step == 4
    assert dict(syncs.kinds) == {"_local_scalar_dense": 3}, syncs.where
    [site] = syncs.where
    assert site.startswith("trainer.py:"), syncs.where


def test_staging_ahead_gives_the_step_of_batches_staged_in_line(tmp_path):
    """The Stager stages micro-batch i + 1 once micro-batch i is queued, and an emptied batch as the
    placeholder; on the CPU that is in line, and the step's weights are those of the plain sequence
    (each micro-batch's loss, backward, then one optimizer step)."""
    empty = Batch([], torch.zeros(0, 1, 16), torch.zeros(0, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long),
                  torch.zeros(0, dtype=torch.long))
    group = [*GROUP[:2], empty, GROUP[2]]
    run, task = make_run(tmp_path / "staged", accum=4)
    calls = []
    stage, loss = task.stage, task.loss
    task.stage = lambda b: calls.append(("stage", list(b.ids))) or stage(b)
    task.loss = lambda model, b, counts: calls.append(("loss", list(b.ids))) or loss(model, b, counts)
    step(run, task, trainer.State(total_steps=10), group)
    ids = [b.ids for b in group[:2]] + [[]] + [group[3].ids]  # the placeholder has no ids
    assert calls == [(kind, i) for i in ids for kind in ("stage", "loss")]

    plain, plain_task = make_run(tmp_path / "plain", accum=4)
    for g in plain.optimizer.param_groups:
        g["lr"] = trainer.learning_rate(plain.training, 0, 10)
    norm = torch.tensor(plain_task.counts(group), dtype=torch.float64).clamp(min=1.0)
    for b in group:
        value, _ = plain_task.loss(plain.model, b if b.ids else plain_task.placeholder(), norm)
        (value * (1.0 if b.ids else 0.0)).backward()
    torch.nn.utils.clip_grad_norm_(plain.model.parameters(), plain.training.grad_clip)
    plain.optimizer.step()
    for (name, a), b in zip(run.model.state_dict().items(), plain.model.state_dict().values()):
        assert torch.equal(a, b), name


class RecordingLoader:
    """A training loader that records set_epoch and the start of its iterations."""

    def __init__(self, events: list):
        self.events, self.epoch = events, 0
        self.batches = self

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch = epoch

    def epoch_batches(self) -> int:
        return 4

    def __iter__(self):
        self.events.append(("iterate", self.epoch))
        return iter([])

    def __len__(self) -> int:
        return 0


def test_the_next_epoch_starts_loading_before_the_validation(tmp_path, monkeypatch):
    """`fit` starts the next epoch's loader (its workers read the first batches) before the
    validation and checkpoint of the epoch that ended, and that epoch trains from that iterator."""
    events: list = []
    loader = RecordingLoader(events)

    def one_epoch(run, state, task, loader, logger, started=None):
        events.append(("train", state.epoch, started and started[0]))
        for _ in started[1] if started else trainer._start_epoch(loader, state.epoch)[1]:
            pass
        return True

    def validate(run, state, task, loader, logger, *, end_of_epoch):
        events.append(("validate", state.epoch))
        state.epoch += 1

    monkeypatch.setattr(trainer, "train_one_epoch", one_epoch)
    monkeypatch.setattr(trainer, "_validate_and_checkpoint", validate)
    monkeypatch.setattr(trainer, "_report_skipped", lambda run, loader: None)
    run, task = make_run(tmp_path, epochs=3)
    trainer.fit(run, trainer.State(), task, trainer.Loaders(loader, None), None)
    assert events == [("train", 0, None), ("iterate", 0), ("iterate", 1), ("validate", 0),
                      ("train", 1, 1), ("iterate", 2), ("validate", 1), ("train", 2, 2), ("validate", 2)]


def test_an_asr_loader_starts_its_workers_when_iterated(corpus, tokenizer):
    """iter() of a loader with worker processes hands them the first batches at once, not at the
    first next(): what lets `fit` start an epoch's loading ahead of time."""
    from data_helpers import loader_config

    from asr.loader import make_loader

    loader = make_loader(corpus[:4], tokenizer, loader_config(num_workers=1, max_batch_seconds=1.5), training=True)
    for epoch in (0, 1):  # the workers persist: the second epoch reuses them
        loader.set_epoch(epoch)
        iterator = iter(loader)
        workers = loader._iterator  # torch's: batches sent to the workers, received from them
        assert (workers._send_idx, workers._rcvd_idx) == (2, 0)  # 2: prefetch_factor x 1 worker
        assert [b.ids for b in iterator]


# ------------------------------------------------------------------ a micro-batch sized for the device


def test_auto_micro_batch_is_the_largest_that_fits_and_divides_the_step():
    from asr.train_config import auto_micro_batch, dividing_cap

    probes = []

    def fits_up_to(limit):
        def fits(seconds):
            probes.append(seconds)
            return seconds <= limit
        return fits

    # 33 utterances of 30 s fit (990 s); with the 0.85 margin 841.5 s, lowered to divide 4000 s: 800 s
    assert auto_micro_batch(fits_up_to(1000), longest=30, global_batch=4000, world_size=1) == 800.0
    assert probes == [30, 60, 120, 240, 480, 960, 1920, 1440, 1200, 1080, 1020, 990]  # doubling, then bisecting
    # 8 processes share 500 s each: the probe stops at that share (over the margin); one micro-batch each
    probes.clear()
    assert auto_micro_batch(fits_up_to(1000), longest=30, global_batch=4000, world_size=8) == 500.0
    assert max(probes) == 600 and len(probes) == 6
    assert auto_micro_batch(fits_up_to(1000), longest=30, global_batch=4000, world_size=3) == 4000 / 3 / 2
    for world, limit in [(1, 35.0), (2, 260.0), (4, 999.0)]:
        cap = auto_micro_batch(fits_up_to(limit), longest=7.0, global_batch=4000, world_size=world, margin=0.9)
        share = 4000 / world
        assert cap <= 0.9 * limit and abs(share / cap - round(share / cap)) < 1e-9
        assert share / round(share / cap - 1) > 0.9 * (limit // 7) * 7  # the next larger divider does not fit
    assert dividing_cap(200, 4000, 1) == 200.0 and dividing_cap(300, 4000, 1) == 4000 / 14
    with pytest.raises(ValueError, match="does not fit"):
        auto_micro_batch(fits_up_to(20), longest=30, global_batch=4000, world_size=1)
    with pytest.raises(ValueError, match="less than the longest"):
        auto_micro_batch(fits_up_to(31), longest=30, global_batch=4000, world_size=1)


def test_the_config_takes_auto():
    from asr.config import ConfigError
    from asr.train_setup import batch_plan, load_experiment_config

    root = Path(__file__).resolve().parents[1] / "conf"
    config = load_experiment_config(str(root / "tiny.yaml"), ["data.max_batch_seconds=auto",
                                                              "training.global_batch_seconds=480"])
    assert config.data.max_batch_seconds == "auto"
    assert batch_plan(config, 2, 60.0) == plan_batches(480.0, 60.0, 1, 2)
    with pytest.raises(ValueError, match="pass the cap"):
        batch_plan(config, 2)
    with pytest.raises(ConfigError, match="'auto' needs training.global_batch_seconds"):
        load_experiment_config(str(root / "tiny.yaml"), ["data.max_batch_seconds=auto"])
    with pytest.raises(ConfigError, match="max_batch_seconds"):
        load_experiment_config(str(root / "tiny.yaml"), ["data.max_batch_seconds=big"])


def test_a_resumed_run_keeps_its_micro_batch(tmp_path):
    """The cap an AutoMicroBatch found is the plan's and goes into the checkpoints; a run resumed
    from one keeps it and probes nothing (another device, or a busier one, would find another)."""
    probed = []

    def auto(found: float) -> trainer.AutoMicroBatch:
        return trainer.AutoMicroBatch(probe=lambda run: probed.append(found) or found,
                                      plan=lambda cap: plan_batches(8.0, cap, 1, 1))

    run, task = make_run(tmp_path)
    run.auto, run.plan = auto(2.0), None
    state = trainer.resume_run(run)
    assert probed == [2.0] and (run.plan.micro_batch, run.plan.accum) == (2.0, 4)
    trainer._save_checkpoint(run, state, valid_loss=None)
    again, _ = make_run(tmp_path)
    again.auto, again.plan = auto(4.0), None
    trainer.resume_run(again)
    assert probed == [2.0] and again.plan == run.plan


def test_auto_on_a_cpu_is_the_documented_cap(tmp_path):
    """data.max_batch_seconds auto without a GPU: AUTO_CPU_SECONDS lowered to divide the step, logged."""
    from test_trainer import asr_train, make_corpus

    manifest = make_corpus(tmp_path / "data", n=2)
    out = asr_train(manifest, tmp_path / "exp", "training.max_steps=1", "data.num_workers=0",
                    "data.max_batch_seconds=auto", "training.global_batch_seconds=600")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no GPU to probe on cpu: AUTO_CPU_SECONDS (200 s) lowered to divide the step" in out.stderr
    assert "data.max_batch_seconds auto: 200 s (the smallest over 1 process(es))" in out.stderr
    assert "a step: 3 micro-batches of at most 200 padded seconds" in out.stderr


@pytest.mark.parametrize("decay_norms_and_biases", [True, False])
def test_weight_decay_can_exclude_norms_and_biases(decay_norms_and_biases):
    """training.decay_norms_and_biases false: one AdamW step with zero gradients shrinks every
    matrix by lr x weight_decay and leaves the biases and LayerNorm parameters as they were (true:
    every parameter shrinks, as before)."""
    import dataclasses

    from small_models import SMALL  # tests/small_models.py

    from asr.model import ASRModel
    from asr.trainer import parameter_groups

    torch.manual_seed(0)
    model = ASRModel(dataclasses.replace(SMALL, encoder="conformer", conv_kernel=5))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # LayerNorm shifts and biases start at 0: make them visible
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.1, decay_norms_and_biases), lr=0.5, weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    norms = {f"{name}.{kind}" for name, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)
             for kind in ("weight", "bias")}
    assert norms
    for name, p in model.named_parameters():
        shrunk = torch.allclose(p, before[name] * (1 - 0.5 * 0.1))
        kept = torch.equal(p, before[name])
        one_d = p.ndim < 2
        assert (kept if one_d and not decay_norms_and_biases else shrunk), name
        assert not (name in norms and not one_d)
