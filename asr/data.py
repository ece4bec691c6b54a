"""Temporary: the names that files not yet updated import from asr.data, which was split into
asr.manifest, asr.corpora, asr.dataset, asr.sampler, asr.feature_archive and asr.loader."""
# ruff: noqa: F401
from asr.corpora import (
    _read_table,  # temporary re-export: removed at integration
    prepare_kaldi,  # temporary re-export: removed at integration
    prepare_librispeech,  # temporary re-export: removed at integration
    speed_perturb,  # temporary re-export: removed at integration
)
from asr.dataset import (
    ASRDataset,  # temporary re-export: removed at integration
    Batch,  # temporary re-export: removed at integration
    Example,  # temporary re-export: removed at integration
    Skipped,  # temporary re-export: removed at integration
    collate,  # temporary re-export: removed at integration
    split_skipped,  # temporary re-export: removed at integration
)
from asr.feature_archive import (
    FeatureArchive,  # temporary re-export: removed at integration
    FeatureArchiveError,  # temporary re-export: removed at integration
)
from asr.loader import (
    DataConfig,  # temporary re-export: removed at integration
    compute_cmvn,  # temporary re-export: removed at integration
    make_loader,  # temporary re-export: removed at integration
)
from asr.manifest import (
    ManifestError,  # temporary re-export: removed at integration
    Utterance,  # temporary re-export: removed at integration
    read_manifest,  # temporary re-export: removed at integration
    write_manifest,  # temporary re-export: removed at integration
)
