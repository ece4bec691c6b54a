"""SpeechBrain's side of the peer benchmark, built as its LibriSpeech transformer recipe builds it
(hparams/transformer.yaml, train.py): ConvolutionFrontEnd -> TransformerASR -> seq_lin / ctc_lin;
S2STransformerBeamSearcher (batched) with CTCScorer as a partial scorer; read_audio + PaddedBatch
+ Fbank + InputNormalization for loading. Runs in the peers' environment (setup.sh).

Differences from the recipe, for equal work with the other two: 256 conv channels, valid
padding, ReLU and no LayerNorm in the front end (the recipe: 64 / 32 channels, same padding,
LeakyReLU, LayerNorm); the CTC scorer scores only the int(1.5 * beam) best tokens (the recipe
scores all: more work); bos is id 1, since SpeechBrain refuses bos == eos with CTC scoring.
"""
from __future__ import annotations

import spec
import torch
from speechbrain.dataio.batch import PaddedBatch
from speechbrain.dataio.dataio import read_audio
from speechbrain.decoders.scorer import CTCScorer, ScorerBuilder
from speechbrain.decoders.seq2seq import S2STransformerBeamSearcher
from speechbrain.lobes.features import Fbank
from speechbrain.lobes.models.convolution import ConvolutionFrontEnd
from speechbrain.lobes.models.transformer.TransformerASR import TransformerASR
from speechbrain.nnet.linear import Linear
from speechbrain.nnet.losses import ctc_loss, nll_loss
from speechbrain.processing.features import InputNormalization

BOS = 1  # the unk id: never a target here
PAD = 0  # target padding (TransformerASR masks pad_idx); blank, never a target either


class ForcedLengthSearcher(S2STransformerBeamSearcher):
    """S2STransformerBeamSearcher whose minimum-length hook (`_set_eos_minus_inf_step`, what
    min_decode_ratio drives) works per utterance: eos is suppressed before step lengths[b] and
    forced at it, so utterance b gets exactly lengths[b] tokens. (max_decode_ratio holds for the
    whole padded batch, so it cannot end utterances at their own lengths.)"""

    def __init__(self, *args, lengths: torch.Tensor, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lengths = lengths  # (B,) long

    def _set_eos_minus_inf_step(self, log_probs: torch.Tensor, step: int, min_decode_steps: int) -> torch.Tensor:
        limits = self.lengths.to(log_probs.device).repeat_interleave(self.beam_size)  # (B * N,)
        eos = log_probs[:, self.eos_index].clone()
        log_probs[limits <= step] = self.minus_inf
        log_probs[:, self.eos_index] = torch.where(limits > step, self.minus_inf, eos)
        return log_probs


class SpeechBrain:
    """The spec.Toolkit of SpeechBrain."""

    name = "speechbrain"

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.cnn = ConvolutionFrontEnd(
            input_shape=(None, None, spec.N_MELS), num_blocks=2, num_layers_per_block=1,
            out_channels=[spec.CONV_CHANNELS] * 2, kernel_sizes=[3, 3], strides=[2, 2], residuals=[False, False],
            activation=torch.nn.ReLU, norm=None, dropout=spec.DROPOUT, padding="valid",
        )
        freq = ((spec.N_MELS - 1) // 2 - 1) // 2  # mel bins left after the two valid convolutions
        self.transformer = TransformerASR(
            tgt_vocab=spec.VOCAB, input_size=freq * spec.CONV_CHANNELS, d_model=spec.D_MODEL, nhead=spec.N_HEADS,
            num_encoder_layers=spec.ENCODER_LAYERS, num_decoder_layers=spec.DECODER_LAYERS, d_ffn=spec.FFN_DIM,
            dropout=spec.DROPOUT, activation=torch.nn.ReLU, normalize_before=True, causal=False,
        )
        self.ctc_lin = Linear(input_size=spec.D_MODEL, n_neurons=spec.VOCAB)
        self.seq_lin = Linear(input_size=spec.D_MODEL, n_neurons=spec.VOCAB)
        with torch.no_grad():
            self.seq_lin.w.bias[spec.EOS] = spec.EOS_BIAS
        self.modules = torch.nn.ModuleList([self.cnn, self.transformer, self.ctc_lin, self.seq_lin])
        self.optimizer = torch.optim.AdamW(self.modules.parameters(), lr=spec.LEARNING_RATE)
        self.fbank = Fbank(n_mels=spec.N_MELS)
        self.normalize = InputNormalization(norm_type="global")

    def parameters(self) -> dict[str, int]:
        t = self.transformer
        subsampling = _count(self.cnn) + _count(t.custom_src_module)
        encoder = subsampling + _count(t.encoder)
        decoder = _count(t.custom_tgt_module) + _count(t.decoder) + _count(self.seq_lin)
        return {"subsampling": subsampling, "encoder": encoder, "decoder": decoder, "ctc": _count(self.ctc_lin),
                "total": _count(self.modules)}

    def encode(self, feats: torch.Tensor, rel_lens: torch.Tensor) -> torch.Tensor:
        """Encoder output (B, T', d) of feats (B, T, n_mels) with relative lengths (B,)."""
        return self.transformer.encode(self.cnn(feats), rel_lens)

    @torch.no_grad()
    def decode(self, utts: spec.Utterances, *, beam_size: int, ctc_weight: float) -> list[list[int]]:
        """The encoder and S2STransformerBeamSearcher on the padded batch (SpeechBrain keeps every
        utterance in the batch until all have ended)."""
        self.modules.eval()
        rel_lens = utts.frames.float() / utts.frames.max()
        scorer = None
        if ctc_weight > 0:
            ctc = CTCScorer(ctc_fc=self.ctc_lin, blank_index=spec.BLANK, eos_index=spec.EOS)
            scorer = ScorerBuilder(partial_scorers=[ctc], weights={"ctc": ctc_weight}, scorer_beam_scale=1.5)
        searcher = ForcedLengthSearcher(
            modules=[self.transformer, self.seq_lin], bos_index=BOS, eos_index=spec.EOS, min_decode_ratio=0.0,
            max_decode_ratio=1.0, beam_size=beam_size, scorer=scorer, using_eos_threshold=False,
            lengths=utts.lengths,
        )
        hyps, _, _, _ = searcher(self.encode(utts.feats, rel_lens), rel_lens)
        return [list(map(int, h)) for h in hyps]

    def train_step(self, batch: spec.TrainBatch) -> float:
        """compute_forward + compute_objectives of the recipe's train.py (no augmentation)."""
        self.modules.train()
        tokens = batch.tokens.clamp(min=PAD)  # (B, L) padded with PAD
        rows = torch.arange(tokens.size(0))
        bos = torch.cat([tokens.new_full((tokens.size(0), 1), BOS), tokens], dim=1)
        eos = torch.cat([tokens, tokens.new_full((tokens.size(0), 1), PAD)], dim=1)
        eos[rows, batch.token_lens] = spec.EOS
        wav_lens = batch.frames.float() / batch.frames.max()
        token_lens = batch.token_lens.float() / tokens.size(1)
        eos_lens = (batch.token_lens + 1).float() / eos.size(1)
        enc, pred = self.transformer(self.cnn(batch.feats), bos, wav_lens, pad_idx=PAD)
        p_ctc = self.ctc_lin(enc).log_softmax(dim=-1)
        p_seq = self.seq_lin(pred).log_softmax(dim=-1)
        loss_seq = nll_loss(p_seq, eos, length=eos_lens, label_smoothing=spec.LABEL_SMOOTHING,
                            reduction="batchmean").sum()
        loss_ctc = ctc_loss(p_ctc, tokens, wav_lens, token_lens, spec.BLANK, reduction="batchmean").sum()
        loss = spec.CTC_WEIGHT_TRAIN * loss_ctc + (1 - spec.CTC_WEIGHT_TRAIN) * loss_seq
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def prepare_loading(self, files: list[spec.AudioFile]) -> None:
        """The global statistics of InputNormalization, accumulated over the files in training
        mode (as the recipe's first epoch does); loading then runs it in eval mode."""
        self.normalize.train()
        with torch.no_grad():
            for f in files:
                feats = self.fbank(read_audio(f.path)[None])
                self.normalize(feats, torch.ones(1))
        self.normalize.eval()

    @torch.no_grad()
    def load(self, files: list[spec.AudioFile], batch_size: int) -> int:
        frames = 0
        for start in range(0, len(files), batch_size):
            chunk = files[start:start + batch_size]
            batch = PaddedBatch([{"id": f.path, "sig": read_audio(f.path)} for f in chunk])
            wavs, wav_lens = batch.sig
            feats = self.normalize(self.fbank(wavs), wav_lens)
            frames += int(torch.round(wav_lens * feats.size(1)).sum())
        return frames


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
