"""Build a tiny random-weight Llama checkpoint, locally, in seconds.

    python examples/tiny_llm/build_tiny_llm.py --out /tmp/tiny-llm
    python examples/tiny_llm/build_tiny_llm.py --out /tmp/llm-27m --hidden 512 --layers 8 --heads 8
    python examples/tiny_llm/build_tiny_llm.py --out /tmp/tiny-llm --archive   # also writes /tmp/tiny-llm.mar
    python examples/tiny_llm/build_tiny_llm.py --out examples/tiny_llm/build/tiny_llm --archive --export-path model_store

The result is an ordinary Hugging Face checkpoint directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a chat template, generation_config.json) plus a
`model-config.yaml` for the `text_generation` handler, so the real loading code
(`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained`) loads it like any model.

Why the weights are shaped the way they are (DESIGN.md §10): a random model with tied embeddings
mostly repeats the prompt's last token under greedy decoding, which a broken batcher reproduces
too. The embeddings are therefore untied, and the output rows of special tokens (EOS included) and
of byte tokens that are not valid text on their own are zeroed: their logit is exactly 0 while the
maximum over ~2k random logits is clearly positive, so greedy answers run to `max_new_tokens` and
decode to clean text. No network access: the tokenizer is trained on `corpus.txt` next to this file.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus.txt"

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]

# A deliberately plain template: role tags as text, BOS once at the start, generation prompt last.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def train_tokenizer(vocab_size: int):
    """Byte-level BPE trained on the local corpus; BOS is prepended to every encoded prompt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS)], trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def build(
    out: Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    vocab_size: int = 2048,
    context: int = 512,
    init_std: float = 0.2,
    default_max_new_tokens: int = 64,
    seed: int = 0,
) -> Path:
    """Write the checkpoint to `out` and return it. Deterministic for a given set of arguments."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    out.mkdir(parents=True, exist_ok=True)
    raw = train_tokenizer(vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=context,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    bos_id, eos_id, pad_id = (raw.token_to_id(t) for t in SPECIAL_TOKENS)

    intermediate = -(-hidden * 8 // 3 // 32) * 32  # Llama's ~8/3 ratio, rounded up to a multiple of 32
    config = LlamaConfig(
        vocab_size=raw.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=context,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[_silent_token_ids(raw)] = 0.0
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        max_new_tokens=default_max_new_tokens,
        do_sample=False,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "model-config.yaml").write_text(_model_config_yaml(), encoding="utf-8")
    return out


def _silent_token_ids(raw) -> list[int]:
    """Special tokens, tokens whose text alone is not valid UTF-8 (stray bytes of a character) and
    control characters other than newline and tab."""
    silent = []
    for token_id in range(raw.get_vocab_size()):
        text = raw.decode([token_id], skip_special_tokens=False)
        printable = all(ch.isprintable() or ch in "\n\t" for ch in text)
        if raw.id_to_token(token_id) in SPECIAL_TOKENS or "\ufffd" in text or not printable:
            silent.append(token_id)
    return silent


def _model_config_yaml() -> str:
    # Frontend keys (camelCase, TorchServe's) at the top; the handler's own keys under `handler:`.
    return (
        "minWorkers: 1\n"
        "maxWorkers: 1\n"
        "batchSize: 8\n"
        "maxBatchDelay: 5\n"
        "responseTimeout: 120\n"
        "continuousBatching: true\n"
        "handler:\n"
        '  model_path: "."\n'
        "  dtype: float32\n"
        "  max_batch_tokens: 8192\n"
        "  prefill_chunk_size: 256\n"
        "  # max_new_tokens: unset, so requests without one use generation_config.json's (64)\n"
    )


def archive(model_dir: Path, export_path: Path, name: str) -> Path | None:
    """Pack `model_dir` into `<export_path>/<name>.mar` with the project's archiver, if it exists yet."""
    files = sorted(p.name for p in model_dir.iterdir() if p.name != "model-config.yaml")
    cmd = [
        sys.executable, "-m", "backend.archiver",
        "--model-name", name,
        "--version", "1.0",
        "--handler", "text_generation",
        "--config-file", str(model_dir / "model-config.yaml"),
        "--extra-files", ",".join(str(model_dir / f) for f in files),
        "--export-path", str(export_path),
        "--force",
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=HERE.parent.parent, capture_output=True, text=True)
    if result.returncode != 0:
        print(f"archiver failed ({result.returncode}): {result.stderr.strip()}", file=sys.stderr)
        return None
    return export_path / f"{name}.mar"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=None, help="default: hidden // 64, at least 4")
    parser.add_argument("--kv-heads", type=int, default=None, help="default: heads // 2 (GQA) for the tiny model")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--context", type=int, default=512, help="max_position_embeddings")
    parser.add_argument("--init-std", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--archive", action="store_true", help="also write <name>.mar (into --export-path)")
    parser.add_argument("--export-path", type=Path, default=None,
                        help="directory for --archive's .mar, e.g. model_store (default: the parent of --out)")
    parser.add_argument("--name", default=None, help="model name for --archive (default: basename of --out)")
    args = parser.parse_args(argv)

    heads = args.heads or max(4, args.hidden // 64)
    kv_heads = args.kv_heads or (max(1, heads // 2) if args.hidden < 256 else heads)
    started = time.perf_counter()
    out = build(
        args.out,
        hidden=args.hidden,
        layers=args.layers,
        heads=heads,
        kv_heads=kv_heads,
        vocab_size=args.vocab_size,
        context=args.context,
        init_std=args.init_std,
        seed=args.seed,
    )
    config = json.loads((out / "config.json").read_text())
    num_params = _count_params(out)
    print(
        f"wrote {out} in {time.perf_counter() - started:.1f}s: vocab {config['vocab_size']}, "
        f"hidden {config['hidden_size']}, layers {config['num_hidden_layers']}, {num_params / 1e6:.1f} M params"
    )
    if args.archive:
        export_path = (args.export_path or out.parent).resolve()  # the archiver runs in the repo root
        export_path.mkdir(parents=True, exist_ok=True)
        mar = archive(out.resolve(), export_path, args.name or out.name)
        if mar is None:
            return 1
        print(f"wrote {mar}")
    return 0


def _count_params(out: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


if __name__ == "__main__":
    raise SystemExit(main())
