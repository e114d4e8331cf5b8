"""Build a local Qwen2-architecture model: random weights plus a byte-level BPE tokenizer.

No network: the tokenizer is trained on text from this Python's standard library, the weights
come from a seeded generator. The same preset and seed give byte-identical weight files
(the weights depend only on the preset's shapes and the seed, never on the tokenizer's merges).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import msgspec

from orchestrator.errors import ConfigError, ModelError

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Written into every directory build_model makes: its preset, seed and parameter count. A model
# directory without it was made elsewhere and is used as it is (ensure_model).
BUILT_MARKER = "inflight_model.json"


class ModelPreset(msgspec.Struct, frozen=True):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    corpus_bytes: int = 2_000_000
    # Standard deviation of the random matrices: 0.08 makes sampled tokens (and hence logprob
    # comparisons) informative; 0.02 gives the near-uniform start that RL learns from quickly.
    init_std: float = 0.08
    # The output head's standard deviation, when not init_std (drawn with init_std, then scaled).
    head_std: float | None = None


# Head size 32 (tiny) and 64 (small): both accepted by vLLM's CPU attention backend.
PRESETS: dict[str, ModelPreset] = {
    # A long context lets tests keep a request generating for as long as they need: a
    # server's stream can lag seconds behind its engine on a busy 2-core machine.
    "tiny": ModelPreset(vocab_size=1024, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=32768, corpus_bytes=1_000_000),
    # The RL toy model: tiny's shapes with a narrow init, so the first policy is close to
    # uniform and a few dozen GRPO steps visibly move it (examples/, tests/unit/test_trainer_loss.py).
    "tiny-rl": ModelPreset(vocab_size=1024, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=4096, corpus_bytes=1_000_000, init_std=0.02),
    "small": ModelPreset(vocab_size=4096, hidden_size=768, intermediate_size=2048,
                         num_hidden_layers=10, num_attention_heads=12, num_key_value_heads=4,
                         corpus_bytes=4_000_000),
    # tiny-rl with an output head 4x wider (std 0.08), as a trained model's head is: an adapter
    # confined to the decoder (vLLM serves no LoRA on Qwen2's head) can then move the output
    # distribution; on tiny-rl's head it cannot (docs/lora.md, "Why tiny-lora"). The LoRA toy.
    "tiny-lora": ModelPreset(vocab_size=1024, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=4096, corpus_bytes=1_000_000, init_std=0.02, head_std=0.08),
    # small's shapes (69M parameters) with tiny-rl's narrow init: the RL workload of
    # `inflight bench time-to-reward`.
    "small-rl": ModelPreset(vocab_size=4096, hidden_size=768, intermediate_size=2048,
                            num_hidden_layers=10, num_attention_heads=12, num_key_value_heads=4,
                            corpus_bytes=4_000_000, init_std=0.02),
}


def _stdlib_corpus(limit_bytes: int) -> list[str]:
    """Standard-library sources in a fixed order, up to limit_bytes of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts


def train_tokenizer(vocab_size: int, corpus_bytes: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_stdlib_corpus(corpus_bytes), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def build_model(out_dir: str | os.PathLike, preset: str = "tiny", seed: int = 0) -> tuple[Path, int]:
    """Write config, safetensors weights and tokenizer to out_dir; return (dir, parameter count).

    The directory is written under a temporary name and renamed into place, so an interrupted
    build never leaves a half-written model that looks complete.
    """
    if preset not in PRESETS:
        raise ConfigError("preset", f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if seed < 0:
        raise ConfigError("seed", f"must be >= 0, got {seed}")
    spec = PRESETS[preset]
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ModelError(out, "directory exists and is not empty")
    tmp = _scratch_dir(out)  # before minutes of work: a place that cannot be written fails now
    try:
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        tokenizer = train_tokenizer(spec.vocab_size, spec.corpus_bytes)
        config = Qwen2Config(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            max_position_embeddings=spec.max_position_embeddings,
            tie_word_embeddings=spec.tie_word_embeddings,
            torch_dtype="float32",
            bos_token_id=None,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        )
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
        # The preset's init_std: see ModelPreset.
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed)
            for _, param in sorted(model.named_parameters()):
                if param.dim() >= 2:
                    param.normal_(0.0, spec.init_std, generator=gen)
            if spec.head_std is not None:  # scaled after the draws: every other tensor as without it
                model.get_output_embeddings().weight.mul_(spec.head_std / spec.init_std)
        n_params = count_parameters(model)

        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / BUILT_MARKER).write_text(
            json.dumps({"preset": preset, "seed": seed, "parameters": n_params}, indent=2) + "\n"
        )
        _make_readable(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelError(out, f"cannot write the model: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, n_params


def _scratch_dir(out: Path) -> Path:
    """The temporary directory beside `out` that the build is written into (renamed at the end)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as exc:
        raise ModelError(out, f"cannot create a directory there: {exc.strerror or exc}") from None


def _make_readable(directory: Path) -> None:
    # mkdtemp creates the directory 0700 and some writers create files 0600; a model directory
    # is shared with engine processes that may run as another user.
    directory.chmod(0o755)
    for child in directory.iterdir():
        child.chmod(0o644)


def check_model_dir(path: str | os.PathLike) -> Path:
    """Raise ModelError naming what is missing unless path is a loadable model directory."""
    p = Path(path)
    if not p.exists():
        raise ModelError(p, "path does not exist (build one with: inflight model init DIR)")
    if not p.is_dir():
        raise ModelError(p, "not a directory")
    if not (p / "config.json").is_file():
        raise ModelError(p, "no config.json")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise ModelError(p, "no weight files (*.safetensors)")
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise ModelError(p, "no tokenizer (tokenizer.json)")
    return p


def ensure_model(path: str | os.PathLike, preset: str = "tiny", seed: int = 0) -> Path:
    """The model directory at path, built from `preset` and `seed` only when path holds no model
    (it does not exist, or has no config.json; `build_model` refuses a non-empty directory).

    A model directory from elsewhere (no inflight_model.json: any Hugging Face directory, e.g.
    written by transformers' `save_pretrained`) is used as it is, after `check_model_dir`. A
    directory built here with another preset or seed is refused, not reused: a run that asked
    for tiny-rl must never silently train a tiny model left behind by an earlier run.
    """
    p = Path(path)
    if not (p / "config.json").is_file():
        try:
            build_model(p, preset=preset, seed=seed)
            return p
        except ModelError:
            # Another process built the same path meanwhile (two runs, or two test sessions, on a
            # fresh checkout): its rename landed first and ours found the place taken. Theirs is
            # used if it was built as asked (a build is a function of preset and seed).
            if not (p / "config.json").is_file():
                raise
    if (p / BUILT_MARKER).exists():
        _check_built_as(p, preset, seed)
    return check_model_dir(p)


def _check_built_as(path: Path, preset: str, seed: int) -> None:
    meta_path = path / BUILT_MARKER
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(path, f"unreadable {BUILT_MARKER}: {exc}") from None
    if not isinstance(meta, dict):
        raise ModelError(path, f"unreadable {BUILT_MARKER}: not a JSON object")
    built = (meta.get("preset"), meta.get("seed"))
    if built != (preset, seed):
        raise ModelError(path, f"built with preset {built[0]!r} seed {built[1]}, but preset {preset!r} seed {seed} "
                               "was asked for; remove the directory or point to another one")


if __name__ == "__main__":  # pragma: no cover - convenience: python -m orchestrator.model DIR
    target = sys.argv[1] if len(sys.argv) > 1 else "models/tiny"
    print(build_model(target)[0])
