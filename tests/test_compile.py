"""training.compile (asr.trainer.compile_blocks): the compiled training step equals the eager one,
and new lengths compile no new graphs."""
from __future__ import annotations

import copy

import pytest
import torch
from small_models import small_model
from test_train_step import batch

from asr.asr_task import ASRTask
from asr.features import FeatureConfig
from asr.trainer import compile_blocks, compiled_graphs

# (frames, tokens) of each utterance: batches of 1 to 4 utterances, every one of a new padded length
BATCHES = [[(60, 5), (44, 3)], [(83, 7), (70, 6), (52, 2)], [(71, 4), (71, 4), (30, 1), (66, 5)],
           [(97, 9), (90, 8)], [(50, 3)], [(48, 6), (47, 2), (40, 3)]]


@pytest.mark.slow
@pytest.mark.parametrize("encoder", ["transformer", "conformer"])
def test_compiled_training_step_equals_eager(encoder, tmp_path, monkeypatch, one_thread):
    """Dropout 0, a tiny model (1 encoder layer, 1 decoder layer) in training mode: over six batches
    of new padded lengths and sizes, the compiled step gives the eager loss to rtol 1e-5 and every
    gradient to atol 1e-5 + rtol 1e-4 (inductor fuses and reorders float32 sums). Graphs: two per
    compiled block class (dynamic shapes: one for all lengths and sizes, one for the batch of one
    utterance), none per length. The Conformer's blocks hold a convolution and stay eager (see
    compile_blocks): only its decoder's are compiled. An empty inductor cache: a cached graph may
    bring the guards of the shapes it was compiled for."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    changes = {"encoder": "conformer", "conv_kernel": 5} if encoder == "conformer" else {}
    eager = small_model(vocab_size=13, encoder_layers=1, decoder_layers=1, **changes).train()
    compiled = copy.deepcopy(eager)
    classes = 2 if encoder == "transformer" else 1  # block classes compiled: encoder layer, decoder layer
    assert compile_blocks(compiled) == classes
    before = compiled_graphs()
    for k, rows in enumerate(BATCHES):
        b = batch(rows, seed=k)
        results = []
        for model in (eager, compiled):
            task = ASRTask(model, None, FeatureConfig(n_mels=16), 0.3, torch.device("cpu"))
            counts = torch.tensor(task.counts([b]), dtype=torch.float64)
            model.zero_grad(set_to_none=True)
            loss, _ = task.loss(model, task.stage(b), counts)
            loss.backward()
            results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        (eager_loss, eager_grads), (loss, grads) = results
        torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0.0)
        assert grads.keys() == eager_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-5, msg=f"batch {k}: {name}")
    assert compiled_graphs() - before == 2 * classes
