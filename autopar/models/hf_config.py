"""Hugging Face transformers models named by ``--model-config``: a config file, or a
checkpoint directory in transformers' layout (``config.json`` inside; weights are never
read).

The model is built from its config with random initialisation, on the device of the
caller's ``torch.device`` context (the meta device for planning), as the class the
config's ``architectures`` names (``BertForMaskedLM``, ``LlamaForCausalLM``), else as a
causal language model, transformers' default for a config without it. What the model is
fed follows its ``main_input_name``: token ids (``input_ids``) or images
(``pixel_values``, of the config's ``image_size``). Encoder-decoder models (T5, BART) are
refused: the planner cuts one stack of blocks into pipeline stages, and their encoder
would be one indivisible unit of the first stage. Every refusal is a one-line
:class:`~autopar.errors.ConfigError` naming the file or model type, why, and what to do.
"""

from __future__ import annotations

import ast
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.errors import ConfigError, first_line
from autopar.models.positions import longest_length_note, max_positions
from autopar.quiet import quiet_imports

CONFIG_NAME = "config.json"
"""The config's file name in a checkpoint directory (``save_pretrained``'s layout)."""

FLAG = "--model-config"

SIZES = {
    "hidden_size": (1, "features"),
    "intermediate_size": (1, "features"),
    "num_attention_heads": (1, "heads"),
    "num_key_value_heads": (1, "heads"),
    "head_dim": (1, "features"),
    "vocab_size": (1, "tokens"),
    "max_position_embeddings": (1, "positions"),
    "num_hidden_layers": (0, "layers"),
}
"""Config sizes checked before transformers reads them (some it divides by): the least
each may be, and what it counts."""
MAX_LAYERS = 10_000
"""The most layers a config may have: a model is built layer by layer before it is
planned, a few milliseconds each."""


@dataclass(frozen=True)
class HFModel:
    """A transformers model to build: its config, the class it is built as, and a line
    saying how that class was chosen when the config did not name it (else None)."""

    config: Any
    class_name: str
    build: Callable[[], nn.Module]
    note: str | None


@dataclass(frozen=True)
class HFInput:
    """What a transformers model is fed: token ids of ``seq_len``, or images of
    ``image_shape`` (C, H, W); ``note`` states a default taken from the config (None when
    the command line gave the size)."""

    seq_len: int | None
    image_shape: tuple[int, ...] | None
    vocab_size: int
    note: str | None

    def sample(self, batch: int, device: str | torch.device) -> dict[str, torch.Tensor]:
        """One batch of keyword inputs on ``device``: random token ids below the
        vocabulary size, or random images."""
        if self.image_shape is not None:
            return {"pixel_values": torch.randn(batch, *self.image_shape, device=device)}
        assert self.seq_len is not None
        return {"input_ids": torch.randint(0, self.vocab_size, (batch, self.seq_len), device=device)}

    def planner_inputs(self) -> dict[str, Any]:
        """The planner's input keywords: ``seq_len`` for a token model (as registered
        token models are planned), else a ``sample_input`` of one image."""
        if self.seq_len is not None:
            return {"seq_len": self.seq_len}
        return {"sample_input": self.sample(1, "meta")}


def load_hf_model(text: str, *, trust_remote_code: bool = False) -> HFModel:
    """The model ``--model-config text`` names, ready to build (a config file, or a
    checkpoint directory holding ``config.json``)."""
    with quiet_imports():
        return _load(text, trust_remote_code)


def _load(text: str, trust_remote_code: bool) -> HFModel:
    transformers = _transformers()
    path = config_file(text)
    raw = _config_dict(path)
    _check_loadable(raw, path, trust_remote_code, transformers)
    source = path.parent if path.name == CONFIG_NAME else path
    try:
        config = transformers.AutoConfig.from_pretrained(str(source), trust_remote_code=trust_remote_code)
    except Exception as exc:  # the config's values (a torch_dtype torch lacks) or its own code: any failure is said
        raise ConfigError(
            f"{FLAG} {str(path)!r} is not a config transformers can read ({first_line(exc)}); give a config.json "
            f"written by save_pretrained."
        ) from None
    _check_layers(config, path)
    _check_experts(config, path)
    return _model_of(config, trust_remote_code, transformers)


def _check_layers(config: Any, path: Path) -> None:
    """Refuses a config of no layers (``num_hidden_layers``, which transformers maps to
    each family's own name, such as GPT-2's ``n_layer``): its model is an embedding and a
    head, whose plan would be planned and explained as if it were the model meant."""
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and not isinstance(layers, bool) and layers < 1:
        name = getattr(config, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")
        raise ConfigError(
            f"{FLAG} {str(path)!r} has {name}={layers}: a model of no layers is its embedding and head "
            f"alone; give the layer count of the model you train (1 or more)."
        )


EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
"""How transformers' mixture-of-experts configs name their expert count (Mixtral, Qwen-MoE,
DeepSeek), each beside ``num_experts_per_tok``."""


def _check_experts(config: Any, path: Path) -> None:
    """Refuses a config routing each token to more experts than it has (or to none): its
    router's top-k fails deep in the trace, which would blame the sample input."""
    k = getattr(config, "num_experts_per_tok", None)
    name = next((f for f in EXPERT_COUNT_FIELDS if getattr(config, f, None) is not None), None)
    count = getattr(config, name) if name else None
    if not isinstance(k, int) or not isinstance(count, int) or isinstance(k, bool) or isinstance(count, bool):
        return
    if count >= 1 and not 1 <= k <= count:  # no experts (0) is a dense variant of some families
        raise ConfigError(
            f"{FLAG} {str(path)!r} routes each token to num_experts_per_tok={k} of its {name}={count} experts; "
            f"route each token to between 1 and {count}."
        )


def config_file(text: str) -> Path:
    """The config file ``--model-config text`` names: the file itself, or a checkpoint
    directory's ``config.json``."""
    path = Path(text)
    if path.is_dir():
        if not (path / CONFIG_NAME).is_file():
            raise ConfigError(
                f"{FLAG} {text!r} is a directory without {CONFIG_NAME}; give a checkpoint directory "
                f"(save_pretrained's layout) or a config file."
            )
        return path / CONFIG_NAME
    if not path.exists():
        raise ConfigError(
            f"{FLAG} {text!r} does not exist; give a Hugging Face config.json or the checkpoint directory holding it."
        )
    return path


def _transformers() -> Any:
    """The transformers package, or a line saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"{FLAG} needs Hugging Face transformers: pip install 'autopar[hf]'.") from None
    return transformers


def _config_dict(path: Path) -> dict[str, Any]:
    """The config file's JSON object, each way it can be unreadable said in one line."""
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{FLAG} {str(path)!r} cannot be read ({exc.strerror or exc}); give a config file.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"{FLAG} {str(path)!r} is not valid JSON ({exc}); give a config.json written by save_pretrained."
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{FLAG} {str(path)!r} holds a JSON {type(raw).__name__}, not a config object; give a config.json "
            f"written by save_pretrained."
        )
    return raw


def _check_loadable(raw: dict[str, Any], path: Path, trust_remote_code: bool, transformers: Any) -> None:
    """Refuse, before transformers reads it, a config it cannot read: custom code that
    was not trusted (transformers would ask on the terminal), custom code outside a
    checkpoint directory, no ``model_type``, a type this transformers does not know, or
    a size it would divide by zero (:data:`SIZES`)."""
    for key, (least, what) in SIZES.items():
        value = raw.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < least:
            raise ConfigError(
                f"{FLAG} {str(path)!r}: {key}={value} is not allowed; it counts {what}, at least {least}. "
                f"Fix the config."
            )
    heads, kv = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and kv >= 1 and heads % kv:
        raise ConfigError(
            f"{FLAG} {str(path)!r}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}; "
            f"each key/value head serves a whole group of query heads. Fix the config."
        )
    layers = raw.get("num_hidden_layers")
    if isinstance(layers, int) and layers > MAX_LAYERS:
        raise ConfigError(
            f"{FLAG} {str(path)!r}: num_hidden_layers={layers} is more than {MAX_LAYERS:,} (the deepest trained "
            f"models have a few hundred; building this many would take hours before planning). Fix the config."
        )
    if "auto_map" in raw:
        if not trust_remote_code:
            raise ConfigError(
                f"{FLAG} {str(path)!r} needs custom code (its auto_map names "
                f"{', '.join(sorted(raw['auto_map']))}); pass --trust-remote-code to run that code, if you trust it."
            )
        if path.name != CONFIG_NAME:
            raise ConfigError(
                f"{FLAG} {str(path)!r} needs custom code, which is read next to {CONFIG_NAME}; give the checkpoint "
                f"directory holding {CONFIG_NAME} and the code's .py files."
            )
        _check_custom_code(raw["auto_map"], path)
        return
    model_type = raw.get("model_type")
    if not model_type:
        raise ConfigError(
            f"{FLAG} {str(path)!r} has no model_type; give a config.json written by save_pretrained "
            f'(e.g. "model_type": "llama").'
        )
    from transformers.models.auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ConfigError(
            f"{FLAG} {str(path)!r}: model_type {model_type!r} is unknown to transformers {transformers.__version__}; "
            f"fix model_type, upgrade transformers, or (a custom model) give its auto_map and --trust-remote-code."
        )


def _check_custom_code(auto_map: Any, path: Path) -> None:
    """Refuse custom code that transformers would fail to import with a traceback of its
    own: a ``.py`` file missing beside ``path`` or one Python cannot parse, among the
    files ``auto_map`` names for the config and model classes (not the tokenizer's, which
    is never loaded) and those they import relatively (``from .x import y``: ``x.py``),
    as transformers reads them. A class in a Hub repository (``repo--module.Class``) is
    refused too: transformers would download it (or wait on the network, then fail)."""
    items = auto_map.items() if isinstance(auto_map, dict) else ()
    refs = [
        (key, ref)
        for key, ref in items
        if (key == "AutoConfig" or key.startswith("AutoModel")) and isinstance(ref, str)
    ]
    for key, ref in refs:
        repo, hub, name = ref.partition("--")
        if hub:
            raise ConfigError(
                f"{FLAG} {str(path)!r}: auto_map's {key} names code in the Hub repository {repo!r} ({ref!r}), which "
                f"autopar does not fetch (it loads custom code from the config's directory only); copy "
                f"{name.rpartition('.')[0]}.py from that repository next to {CONFIG_NAME} and set {key} to {name!r}."
            )
    todo = [path.parent / f"{ref.rpartition('.')[0]}.py" for _, ref in refs]
    seen: set[Path] = set()
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        where = f"{FLAG} {str(path)!r}: its custom code {str(file)!r}"
        if not file.is_file():
            raise ConfigError(
                f"{where} is missing; copy the checkpoint's .py files next to {CONFIG_NAME}, or fix auto_map."
            )
        try:
            tree = ast.parse(file.read_bytes(), str(file))
        except SyntaxError as exc:
            raise ConfigError(
                f"{where} is not valid Python ({exc.msg}, line {exc.lineno}); fix the file or copy it from the "
                f"checkpoint again."
            ) from None
        todo += [
            file.parent / f"{node.module}.py"
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        ]


def _model_of(config: Any, trust_remote_code: bool, transformers: Any) -> HFModel:
    """How to build ``config``'s model: the class its ``architectures`` names, else
    transformers' causal language model for its type."""
    names = getattr(config, "architectures", None) or []
    if isinstance(names, str):  # one class name written without its list
        names = [names]
    if names and not isinstance(names[0], str):
        raise ConfigError(
            f"{FLAG}: architectures is {names!r}; give the class to build by name, e.g. "
            f'"architectures": ["LlamaForCausalLM"].'
        )
    if names:
        return _named_class(config, names[0], trust_remote_code, transformers)
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        name = auto_map["AutoModelForCausalLM"].rpartition(".")[2]
        return _remote(config, transformers.AutoModelForCausalLM, name, _default_note(name))
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING_NAMES

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None:
        base = MODEL_MAPPING_NAMES.get(config.model_type, "the model class")
        raise ConfigError(
            f"{FLAG}: a {config.model_type} config without architectures is built as a causal language model, "
            f"and {config.model_type} has none; add the class to build to the config, e.g. "
            f'"architectures": ["{base}"].'
        )
    return HFModel(
        config, cls.__name__, lambda: cls._from_config(config, dtype=torch.float32), _default_note(cls.__name__)
    )


def _named_class(config: Any, name: str, trust_remote_code: bool, transformers: Any) -> HFModel:
    """The model class ``architectures`` names: transformers' own (``getattr`` on the
    package, checked to be a model class for this config), or custom code's."""
    try:
        cls = getattr(transformers, name, None)
    except ImportError as exc:  # a model class whose optional dependency is missing
        raise ConfigError(f"{FLAG}: building {name} needs a package that is missing ({first_line(exc)}).") from None
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
        if not isinstance(config, cls.config_class):
            raise ConfigError(
                f"{FLAG}: architectures names {name}, a {cls.config_class.model_type} model, but the config's "
                f"model_type is {config.model_type!r}; make the two agree."
            )
        # _from_config is what the Auto classes' from_config calls: random init, in fp32 (the
        # master weights autopar's runtime keeps) whatever torch_dtype the checkpoint's config names
        return HFModel(config, name, lambda: cls._from_config(config, dtype=torch.float32), None)
    auto_map = getattr(config, "auto_map", None) or {}
    auto = next((key for key, ref in auto_map.items() if ref.rpartition(".")[2] == name), None)
    if trust_remote_code and auto is not None and auto != "AutoConfig":
        return _remote(config, getattr(transformers, auto), name, None)
    raise ConfigError(
        f"{FLAG}: architectures names {name!r}, which is not a model class of transformers "
        f"{transformers.__version__}; fix architectures (e.g. LlamaForCausalLM), upgrade transformers, or for "
        f"custom code map it in auto_map and pass --trust-remote-code."
    )


def _remote(config: Any, auto: Any, name: str, note: str | None) -> HFModel:
    """A custom-code model, built through the Auto class its ``auto_map`` lists."""
    return HFModel(config, name, lambda: auto.from_config(config, trust_remote_code=True, dtype=torch.float32), note)


def _default_note(name: str) -> str:
    """The line saying which class a config without ``architectures`` was built as."""
    return (
        f"model {name} (the config names no architectures: built as a causal language model; add "
        f'"architectures" to the config to build another class)'
    )


def build_hf_model(hf: HFModel, device: str | torch.device) -> nn.Module:
    """``hf``'s model built on ``device``; a config whose values the class rejects is one
    line naming the class."""
    try:
        with torch.device(device), quiet_imports():
            return hf.build()
    except (
        ValueError,
        TypeError,
        AttributeError,
        KeyError,
        IndexError,
        RuntimeError,
        ImportError,
        ArithmeticError,
    ) as exc:
        raise ConfigError(
            f"{FLAG}: building {hf.class_name} from the config failed ({type(exc).__name__}: {first_line(exc)}); "
            f"check the config's values."
        ) from None


def hf_input(
    model: nn.Module,
    config: Any,
    *,
    seq_len: int | None,
    sample_shape: tuple[int, ...] | None,
    shape_flag: str = "--sample-shape",
) -> HFInput:
    """What ``model`` is fed: token ids at ``seq_len`` (the config's maximum length by
    default), or images of ``sample_shape`` (the config's image size by default); the
    option that does not apply to the model is refused rather than ignored, and so are
    encoder-decoder models (they take ``decoder_input_ids``) and other inputs (audio)."""
    kind = f"{type(model).__name__} ({config.model_type})"
    if "decoder_input_ids" in inspect.signature(model.forward).parameters:
        raise ConfigError(
            f"{kind} is an encoder-decoder model, which autopar does not plan: it cuts one stack of blocks into "
            f"pipeline stages and would keep the whole encoder in the first; {_encoder_only(config)}."
        )
    main = getattr(model, "main_input_name", "input_ids")
    if main == "input_ids":
        if sample_shape is not None:
            raise ConfigError(
                f"{shape_flag} is for models without token input; {kind} takes token ids: give --seq-len."
            )
        try:
            vocab = model.get_input_embeddings().num_embeddings
        except NotImplementedError:  # a model of several towers (CLIP: text and images) has no one embedding
            raise ConfigError(
                f"{kind} has no single token embedding: it runs several towers on several inputs, and "
                f"{FLAG} makes one kind of sample; {_one_tower(config)}."
            ) from None
        length, note = _token_length(model, kind, seq_len)
        return HFInput(seq_len=length, image_shape=None, vocab_size=vocab, note=note)
    if main == "pixel_values":
        if seq_len is not None:
            raise ConfigError(
                f"--seq-len is for token models; {kind} takes images (pixel_values): leave it out, or give "
                f"{shape_flag} C,H,W."
            )
        shape, note = (sample_shape, None) if sample_shape is not None else _image_shape(config, kind, shape_flag)
        return HFInput(seq_len=None, image_shape=shape, vocab_size=0, note=note)
    raise ConfigError(
        f"{kind} takes {main}, of which {FLAG} cannot make a sample (it makes token ids and images); plan it "
        f"from Python: autopar.plan(model, ..., sample_input={{{main!r}: one batch}})."
    )


def _one_tower(config: Any) -> str:
    """What to plan instead of a model of several towers: one of them, where transformers
    has a class for it (``CLIPTextModel``, ``CLIPVisionModel``), else from Python."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    stem = MODEL_MAPPING_NAMES.get(config.model_type, "").removesuffix("Model")
    towers = []
    for part in ("Text", "Vision") if stem else ():
        tower = getattr(transformers, f"{stem}{part}Model", None)
        if isinstance(tower, type) and hasattr(tower, "config_class"):
            key = f"{part.lower()}_config"
            source = f'its "{key}"' if hasattr(config, key) else "a config"
            towers.append(
                f'{source} with "model_type": "{tower.config_class.model_type}" and "architectures": '
                f'["{tower.__name__}"]'
            )
    if towers:
        return "plan one tower: " + ", or ".join(towers)
    return "plan it from Python: autopar.plan(model, ..., sample_input={...}) with every input it takes"


def _encoder_only(config: Any) -> str:
    """What to plan instead of an encoder-decoder model: its encoder alone where
    transformers has a class for it (``T5EncoderModel``), else another model."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    base = MODEL_MAPPING_NAMES.get(config.model_type, "")
    encoder = base.removesuffix("Model") + "EncoderModel"
    if base and isinstance(getattr(transformers, encoder, None), type):
        return f'plan its encoder alone: set "architectures": ["{encoder}"] in the config'
    return "plan a decoder-only or encoder-only model instead"


def _token_length(model: nn.Module, kind: str, seq_len: int | None) -> tuple[int, str | None]:
    """``--seq-len``, else the model's maximum length with a line warning so."""
    if seq_len is not None:
        return seq_len, None
    limit = max_positions(model)
    if limit is None:
        raise ConfigError(
            f"{kind} has no maximum sequence length in its config (its positions are relative); give --seq-len, "
            f"e.g. --seq-len 512."
        )
    return limit[0], longest_length_note(limit, "--seq-len", getattr(model, "config", None))


def _image_shape(config: Any, kind: str, shape_flag: str) -> tuple[tuple[int, ...], str]:
    """One image of the config's ``num_channels`` and ``image_size``, with a line saying so."""
    size = getattr(config, "image_size", None)
    channels = getattr(config, "num_channels", 3)
    if isinstance(size, int):
        size = (size, size)
    if not (isinstance(size, (list, tuple)) and len(size) == 2):
        raise ConfigError(f"{kind} has no image_size in its config; give one image's shape: {shape_flag} C,H,W.")
    shape = (int(channels), int(size[0]), int(size[1]))
    return shape, (
        f"sample {'x'.join(map(str, shape))} (the config's num_channels and image_size; pass {shape_flag} to change)"
    )
