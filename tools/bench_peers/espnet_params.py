"""ESPnet's parameter counts of the LibriSpeech recipes that our conformer configs follow, counted on
the models ESPnet itself builds from the recipes' encoder_conf / decoder_conf (copied below).
Runs in an environment with espnet, not the project's .venv; tools/count_params.py --espnet runs it
and prints our counts beside these.

    PY=~/.cache/asr-espnet-count/venv/bin/python
    $PY tools/bench_peers/espnet_params.py --vocab-size 5002 --out espnet_params.json

A lean environment for it (about 1 GB; the peer benchmark's, tools/bench_peers/setup.sh, works too):

    python3.11 -m venv ~/.cache/asr-espnet-count/venv
    $PY -m pip install <a CPU build of torch>     # any torch >= 2.1; CPU: 0.9 GB, the CUDA build 5 GB
    $PY -m pip install --no-deps espnet==202511 && $PY -m pip install numpy typeguard packaging

The encoder, decoder and CTC modules import nothing else of espnet's dependencies.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json

import torch
from espnet2.asr.ctc import CTC
from espnet2.asr.decoder.transformer_decoder import TransformerDecoder
from espnet2.asr.encoder.conformer_encoder import ConformerEncoder

N_MELS = 80  # ESPnet's default frontend (and ours)

_CONFORMER_COMMON = {
    "num_blocks": 12, "dropout_rate": 0.1, "positional_dropout_rate": 0.1, "attention_dropout_rate": 0.1,
    "input_layer": "conv2d", "normalize_before": True, "macaron_style": True, "rel_pos_type": "latest",
    "pos_enc_layer_type": "rel_pos", "selfattention_layer_type": "rel_selfattn", "activation_type": "swish",
    "use_cnn_module": True, "cnn_module_kernel": 31,
}
_DECODER_COMMON = {
    "num_blocks": 6, "dropout_rate": 0.1, "positional_dropout_rate": 0.1, "self_attention_dropout_rate": 0.1,
    "src_attention_dropout_rate": 0.1,
}

# our config file -> the ESPnet recipe it follows (egs2/...), with that file's encoder_conf and decoder_conf
RECIPES = {
    "librispeech_100h_conformer.yaml": {
        "recipe": "egs2/librispeech_100/asr1/conf/tuning/"
                  "train_asr_conformer_lr2e-3_warmup15k_amp_nondeterministic.yaml",
        "encoder_conf": {"output_size": 256, "attention_heads": 4, "linear_units": 1024, **_CONFORMER_COMMON},
        "decoder_conf": {"attention_heads": 4, "linear_units": 2048, **_DECODER_COMMON},
    },
    "librispeech_960h_conformer.yaml": {
        "recipe": "egs2/librispeech/asr1/conf/tuning/train_asr_conformer10_hop_length160.yaml",
        "encoder_conf": {"output_size": 512, "attention_heads": 8, "linear_units": 2048, **_CONFORMER_COMMON},
        "decoder_conf": {"attention_heads": 8, "linear_units": 2048, **_DECODER_COMMON},
    },
}


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def espnet_counts(recipe: dict, vocab_size: int) -> dict[str, int]:
    """Parameters of ESPnet's ConformerEncoder, TransformerDecoder and CTC of `recipe` at V = vocab_size
    (built on the meta device: no memory, no time)."""
    with torch.device("meta"):
        encoder = ConformerEncoder(input_size=N_MELS, **recipe["encoder_conf"])
        d_model = encoder.output_size()
        decoder = TransformerDecoder(vocab_size=vocab_size, encoder_output_size=d_model, **recipe["decoder_conf"])
        ctc = CTC(odim=vocab_size, encoder_output_size=d_model)
    parts = {"subsampling": count(encoder.embed), "encoder": count(encoder), "decoder": count(decoder),
             "ctc": count(ctc)}
    return {**parts, "enc+dec": parts["encoder"] + parts["decoder"],
            "total": parts["encoder"] + parts["decoder"] + parts["ctc"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, required=True, help="V, the same for every recipe")
    parser.add_argument("--out", required=True, help="JSON file to write (espnet prints a notice on stdout)")
    args = parser.parse_args()
    out = {
        "espnet": importlib.metadata.version("espnet"), "torch": torch.__version__, "vocab_size": args.vocab_size,
        "configs": {name: {"recipe": r["recipe"], **espnet_counts(r, args.vocab_size)} for name, r in RECIPES.items()},
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
