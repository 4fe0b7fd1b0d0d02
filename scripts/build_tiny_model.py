"""Build the tiny random-weight Llama the real-engine tier serves (run with .venv-vllm's python).

No hub access: the config, the weights (seeded, random) and a byte-level BPE tokenizer are all made here.
Output text is random; tests assert on structure and use `ignore_eos` + `max_tokens` for lengths.
"""

from __future__ import annotations

import json
import os
import random
import string
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SEED = 1234
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus(rng: random.Random, lines: int = 4000) -> list[str]:
    words = [
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 9))) for _ in range(600)
    ]
    out = []
    for _ in range(lines):
        parts = [rng.choice(words) for _ in range(rng.randint(3, 14))]
        line = " ".join(parts) + rng.choice([".", ",", "!", "?", ":", ";"])
        if rng.random() < 0.3:
            line += " " + json.dumps({rng.choice(words): rng.randint(0, 999)})
        if rng.random() < 0.2:
            line += " " + "".join(rng.choice(string.printable[:95]) for _ in range(12))
        out.append(line)
    return out


def build_tokenizer(target: Path, rng: random.Random) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # The full 256-byte alphabet: without it deltas carry U+FFFD halves and empty strings.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(rng), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<tool_call>", "</tool_call>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1024
    fast.save_pretrained(target)


def build_model(target: Path, vocab_size: int, eos_id: int, bos_id: int, pad_id: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,  # must be one of 32, 64, 80, 96, ... for the CPU attention backend
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(target)


def main() -> int:
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ".tools/tiny-model")
    tmp = target.with_name(target.name + ".partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    rng = random.Random(SEED)
    build_tokenizer(tmp, rng)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp)
    build_model(tmp, len(tok), tok.eos_token_id, tok.bos_token_id, tok.pad_token_id)
    # Sanity: every byte round-trips, the template renders.
    sample = "".join(chr(c) for c in range(32, 127))
    assert tok.decode(tok.encode(sample, add_special_tokens=False)) == sample
    tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    tmp.rename(target)
    print(f"tiny model: {target} (vocab {len(tok)}, hidden 128, 2 layers, 4 heads x 32)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
