"""ESPnet's side of the peer benchmark (espnet2, as its LibriSpeech-100h transformer recipe builds
it): ESPnetASRModel with TransformerEncoder (conv2d input layer), TransformerDecoder and CTC;
BatchBeamSearch with the decoder and CTCPrefixScorer; SoundScpReader + pad_list + DefaultFrontend
+ GlobalMVN for loading. Runs in the peers' environment (setup.sh).

Collation is espnet2.train.collate_fn.common_collate_fn's work (torch.from_numpy, pad_list,
lengths) written out: importing that module imports the text preprocessors, and g2p_en then tries
to download NLTK data.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np
import spec
import torch
from espnet.nets.batch_beam_search import BatchBeamSearch
from espnet.nets.pytorch_backend.nets_utils import pad_list
from espnet.nets.scorers.ctc import CTCPrefixScorer
from espnet2.asr.ctc import CTC
from espnet2.asr.decoder.transformer_decoder import TransformerDecoder
from espnet2.asr.encoder.transformer_encoder import TransformerEncoder
from espnet2.asr.espnet_model import ESPnetASRModel
from espnet2.asr.frontend.default import DefaultFrontend
from espnet2.fileio.sound_scp import SoundScpReader
from espnet2.layers.global_mvn import GlobalMVN

# the recipe's frontend: 25 ms window (400 samples) in a 512-point FFT, 10 ms hop
FRONTEND = {"fs": spec.SAMPLE_RATE, "n_fft": 512, "win_length": 400, "hop_length": 160, "n_mels": spec.N_MELS}


def build_model() -> ESPnetASRModel:
    """The benchmark's transformer as an ESPnetASRModel on features (no frontend, no normalize:
    the decoding and training inputs are already normalized features)."""
    tokens = ["<blank>", "<unk>", *(f"t{i}" for i in range(2, spec.VOCAB - 1)), "<sos/eos>"]
    encoder = TransformerEncoder(
        input_size=spec.N_MELS, output_size=spec.D_MODEL, attention_heads=spec.N_HEADS, linear_units=spec.FFN_DIM,
        num_blocks=spec.ENCODER_LAYERS, dropout_rate=spec.DROPOUT, positional_dropout_rate=spec.DROPOUT,
        attention_dropout_rate=0.0, input_layer="conv2d", normalize_before=True,
    )
    decoder = TransformerDecoder(
        vocab_size=spec.VOCAB, encoder_output_size=spec.D_MODEL, attention_heads=spec.N_HEADS,
        linear_units=spec.FFN_DIM, num_blocks=spec.DECODER_LAYERS, dropout_rate=spec.DROPOUT,
        positional_dropout_rate=spec.DROPOUT, self_attention_dropout_rate=0.0, src_attention_dropout_rate=0.0,
    )
    ctc = CTC(odim=spec.VOCAB, encoder_output_size=spec.D_MODEL)
    return ESPnetASRModel(
        vocab_size=spec.VOCAB, token_list=tokens, frontend=None, specaug=None, normalize=None, preencoder=None,
        encoder=encoder, postencoder=None, decoder=decoder, ctc=ctc, joint_network=None,
        ctc_weight=spec.CTC_WEIGHT_TRAIN, lsm_weight=spec.LABEL_SMOOTHING, report_cer=False, report_wer=False,
    )


class ESPnet:
    """The spec.Toolkit of ESPnet."""

    name = "espnet"

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = build_model()
        if (self.model.sos, self.model.eos, self.model.blank_id) != (spec.EOS, spec.EOS, spec.BLANK):
            raise AssertionError("ESPnet's token ids differ from the benchmark's")
        with torch.no_grad():
            self.model.decoder.output_layer.bias[spec.EOS] = spec.EOS_BIAS
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=spec.LEARNING_RATE)
        self.frontend = DefaultFrontend(**FRONTEND, frontend_conf=None).eval()
        self.normalize: GlobalMVN | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-peers-espnet-")

    def parameters(self) -> dict[str, int]:
        m = self.model
        return {"subsampling": _count(m.encoder.embed), "encoder": _count(m.encoder), "decoder": _count(m.decoder),
                "ctc": _count(m.ctc), "total": _count(m)}

    def searcher(self, beam_size: int, ctc_weight: float) -> BatchBeamSearch:
        """BatchBeamSearch as espnet2.bin.asr_inference.Speech2Text builds it (no LM, no length
        bonus): the decoder (full scorer) and, with ctc_weight > 0, CTCPrefixScorer (partial,
        on the int(1.5 * beam) best tokens of the full scorers)."""
        scorers = {"decoder": self.model.decoder}
        weights = {"decoder": 1.0 - ctc_weight}
        if ctc_weight > 0:
            scorers["ctc"] = CTCPrefixScorer(ctc=self.model.ctc, eos=self.model.eos)
            weights["ctc"] = ctc_weight
        search = BatchBeamSearch(scorers=scorers, weights=weights, beam_size=beam_size, vocab_size=spec.VOCAB,
                                 sos=self.model.sos, eos=self.model.eos, token_list=None, pre_beam_score_key="full")
        return search.eval()

    @torch.no_grad()
    def decode(self, utts: spec.Utterances, *, beam_size: int, ctc_weight: float) -> list[list[int]]:
        """The encoder on the padded batch, then BatchBeamSearch (one utterance at a time: it
        batches the hypotheses of one utterance) over each utterance's own frames, with
        maxlenratio = -L (exactly L steps; eos appended at the last)."""
        self.model.eval()
        search = self.searcher(beam_size, ctc_weight)
        memory, memory_lens = self.model.encode(utts.feats, utts.frames)
        found = []
        for x, n, length in zip(memory, memory_lens.tolist(), utts.lengths.tolist()):
            best = search(x[:n], maxlenratio=-float(length), minlenratio=0.0)[0]
            found.append(best.yseq[1:-1].tolist())  # without sos and eos
        return found

    def train_step(self, batch: spec.TrainBatch) -> float:
        self.model.train()
        loss, _, _ = self.model(batch.feats, batch.frames, batch.tokens.clone(), batch.token_lens)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def prepare_loading(self, files: list[spec.AudioFile]) -> None:
        """wav.scp of the files; GlobalMVN statistics (count, sum, sum_square: what
        `espnet2.bin.launch collect_stats` writes) of the frontend's features."""
        self.scp = os.path.join(self._tmp.name, "wav.scp")
        with open(self.scp, "w") as f:
            f.writelines(f"utt{k:03d} {a.path}\n" for k, a in enumerate(files))
        total, squares, count = np.zeros(spec.N_MELS), np.zeros(spec.N_MELS), 0
        reader = SoundScpReader(self.scp, dtype="float32")
        with torch.no_grad():
            for key in reader.keys():
                wave = torch.from_numpy(reader[key][1])[None]
                feats, _ = self.frontend(wave, torch.tensor([wave.size(1)]))
                feats = feats[0].double().numpy()
                total, squares, count = total + feats.sum(0), squares + (feats**2).sum(0), count + len(feats)
        stats = os.path.join(self._tmp.name, "feats_stats.npz")
        np.savez(stats, count=count, sum=total, sum_square=squares)
        self.normalize = GlobalMVN(stats)

    @torch.no_grad()
    def load(self, files: list[spec.AudioFile], batch_size: int) -> int:
        reader = SoundScpReader(self.scp, dtype="float32")
        keys = list(reader.keys())
        frames = 0
        for start in range(0, len(keys), batch_size):
            waves = [torch.from_numpy(reader[key][1]) for key in keys[start:start + batch_size]]
            speech, speech_lens = pad_list(waves, 0.0), torch.tensor([len(w) for w in waves])
            feats, lens = self.frontend(speech, speech_lens)
            feats, lens = self.normalize(feats, lens)
            frames += int(lens.sum())
        return frames


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
