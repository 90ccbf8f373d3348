"""BERT model configurations and the pretraining losses. No Horovod here.

Presets follow Google's BERT sizes (Turc et al. 2019 for the small ones):
the model is always built from a BertConfig, never downloaded.
"""
import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from hvdtrain.data.bert_corpus import WordPieceTokenizer, save_tokenizer, vocab_hash
from hvdtrain.errors import UsageError
from hvdtrain.options import BERT_PRESETS

PRESETS = BERT_PRESETS  # the --model choices (options.py)


def preset_config(name, vocab_size):
    if name not in PRESETS:
        raise UsageError(f"unknown model preset {name!r} (choose from {', '.join(PRESETS)})")
    return config_from(dict(vocab_size=vocab_size, max_position_embeddings=512, type_vocab_size=2,
                            hidden_act="gelu", **PRESETS[name]))


def config_from(values):
    """A BertConfig's values as attributes, without importing transformers (seconds on every
    rank) until build_model: a run that builds no model (a finished run's relaunch) never does."""
    return SimpleNamespace(**values)


def import_transformers():
    """transformers' BERT imported now, not at its first use (1.3 s of imports here). An --elastic
    spare stands by in hvd.init(), and the world that takes its slot waits for all it does after:
    the trainer imports it before."""
    from transformers import BertConfig, BertForPreTraining  # noqa: F401


def json_config(path, vocab_size):
    """A BertConfig from a JSON file; its vocab_size, if present, must match the data's."""
    from transformers import BertConfig
    path = Path(path)
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read --config {path}: {error}") from None
    if not isinstance(values, dict):
        raise UsageError(f"--config {path} is not a JSON object")
    if values.get("vocab_size", vocab_size) != vocab_size:
        raise UsageError(f"--config {path} has vocab_size {values['vocab_size']}, "
                         f"but the shards' vocabulary has {vocab_size} tokens")
    values["vocab_size"] = vocab_size
    try:
        return config_from(BertConfig(**values).to_dict())  # transformers' defaults filled in
    except (TypeError, ValueError) as error:
        raise UsageError(f"invalid --config {path}: {error}") from None


def check_sequence_length(config, max_seq_length):
    if config.max_position_embeddings < max_seq_length:
        raise UsageError(f"the model has max_position_embeddings {config.max_position_embeddings}, "
                         f"shorter than the shards' max_seq_length {max_seq_length}")


ARCHITECTURE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "hidden_act", "max_position_embeddings", "type_vocab_size")


HF_CONFIG = "config.json"  # what save_pretrained writes first: a Hugging Face model directory


def is_pretrained_directory(path):
    """Whether ``path`` is a Hugging Face model directory (``save_pretrained``'s), not our checkpoints."""
    return (Path(path) / HF_CONFIG).is_file()


def load_pretrained(directory):
    """A Hugging Face BERT directory as an init checkpoint: {"model", "bert_config", "vocab_sha256",
    "train_state", "source", "fresh_heads"}. Its weights, its configuration (BertConfig) and its
    tokenizer's vocabulary, which the shards must have been prepared with (``prepare_bert_data.py
    --vocab DIR``). A model saved without the pretraining heads (BertModel, BertForMaskedLM)
    gets them freshly initialised (``fresh_heads`` names them). Never downloads."""
    from transformers import BertConfig, BertForPreTraining
    from transformers.utils import logging as transformers_logging
    directory = Path(directory)
    try:
        config = BertConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as error:
        raise UsageError(f"--init-checkpoint {directory}: cannot read its {HF_CONFIG} ({first_line(error)})") from None
    if config.model_type != "bert":
        raise UsageError(f"--init-checkpoint {directory} holds a {config.model_type!r} model, not a BERT")
    try:
        tokenizer = WordPieceTokenizer.load(directory, lowercase=True)
    except Exception as error:  # noqa: BLE001 - a missing or broken tokenizer: one line
        raise UsageError(f"--init-checkpoint {directory}: no usable tokenizer (tokenizer.json or vocab.txt) "
                         f"beside the model ({error.__class__.__name__}): continued pretraining needs the "
                         "vocabulary it was trained with") from None
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # heads missing: said below in one line, not a page
    transformers_logging.disable_progress_bar()  # no "Loading weights" bar on every rank's stderr
    try:
        model, info = BertForPreTraining.from_pretrained(str(directory), local_files_only=True,
                                                         output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as error:
        raise UsageError(f"--init-checkpoint {directory}: cannot load its weights ({first_line(error)})") from None
    finally:
        transformers_logging.set_verbosity(verbosity)
        transformers_logging.enable_progress_bar()
    return {"model": model.state_dict(), "bert_config": model.config.to_dict(), "vocab_sha256": vocab_hash(tokenizer),
            "train_state": {"step": 0}, "source": "huggingface",
            "fresh_heads": sorted({key.split(".")[0] + "." + key.split(".")[1] for key in info["missing_keys"]})}


def first_line(error):
    return (str(error).strip().splitlines() or [""])[0][:200]


def build_model(config):
    from transformers import BertConfig, BertForPreTraining
    return BertForPreTraining(BertConfig(**vars(config)))


def pretraining_sums(model, batch, encoder=None):
    """Summed MLM and NSP losses with their counts and correct predictions.

    Like NVIDIA's implementation, only the masked positions go through the
    vocabulary-sized decoder: ~15% of the tokens instead of all of them.
    ``encoder`` is ``model.bert`` or a compiled version of it.
    """
    encoder = model.bert if encoder is None else encoder  # not `or`: a compiled module has no truth value
    sequence, pooled = encoder(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                               attention_mask=batch["attention_mask"], return_dict=False)[:2]
    labels = batch["labels"]
    masked = labels != -100
    mlm_logits = model.cls.predictions(sequence[masked]).float()
    mlm_targets = labels[masked]
    nsp_logits = model.cls.seq_relationship(pooled).float()
    nsp_targets = batch["next_sentence_label"]
    return {
        "mlm_loss": F.cross_entropy(mlm_logits, mlm_targets, reduction="sum"),
        "mlm_correct": (mlm_logits.argmax(-1) == mlm_targets).sum(),
        "mlm_count": int(mlm_targets.numel()),
        "nsp_loss": F.cross_entropy(nsp_logits, nsp_targets, reduction="sum"),
        "nsp_correct": (nsp_logits.argmax(-1) == nsp_targets).sum(),
        "nsp_count": int(nsp_targets.numel()),
    }


class PretrainingObjective(torch.nn.Module):
    """``pretraining_sums`` as a module's forward, so that DDP can wrap it (benchmark)."""

    def __init__(self, model, encoder=None):
        super().__init__()
        self.model = model
        # The (compiled) encoder shares model.bert's parameters: kept out of the
        # module tree so they are not registered twice.
        self.__dict__["encoder"] = encoder

    def forward(self, batch):
        return pretraining_sums(self.model, batch, self.encoder)


def training_loss(sums, over=None):
    """BERT's objective: mean MLM loss over masked tokens + mean NSP loss.

    ``over``: (masked tokens, sequences) of a whole step on every rank instead of
    these sums' own counts: this micro-batch's share of the step's global mean.
    """
    tokens, sequences = (sums["mlm_count"], sums["nsp_count"]) if over is None else over
    return sums["mlm_loss"] / max(1, tokens) + sums["nsp_loss"] / max(1, sequences)


def export(model, tokenizer, directory):
    """A Hugging Face model directory (like bert-base-uncased: pretraining heads included).

    ``BertForMaskedLM.from_pretrained`` and the fill-mask pipeline load it as is;
    fine-tuning classes keep the NSP-trained pooler.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.architectures = ["BertForPreTraining"]
    # Transformers' "Writing model shards" bar would end the run log with a stray tqdm line.
    from transformers.utils import logging as transformers_logging
    transformers_logging.disable_progress_bar()
    model.save_pretrained(str(directory))
    save_tokenizer(tokenizer, directory)
    return directory
