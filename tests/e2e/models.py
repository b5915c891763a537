"""Tiny random-weight checkpoints for the real sglang server on CPU, written at test time (no download).

Weights come from transformers' own model classes (``save_pretrained``), so sglang loads a checkpoint
laid out exactly as a real one: Qwen3 (an ordinary model) and qwen4_exp (36 GDN + 12 QSA layers in the
real one; here 3 GDN + 1 QSA, PLE on two GDN layers, MoE, hyper-connections). The tokenizer is a
1,000-token byte-level BPE trained here on local text, with a ChatML template. Random weights write
nonsense: these models exercise control flow, never output quality.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 1000
PLE_LAYER_IDS = [1, 2]  # 1-based decoder layers; both are linear (GDN) layers
SPLIT_NGRAM_PARTS = 4


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def write_tokenizer(out: Path, extra_special: list[str] = ()) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from sglang_ssd_stream.operate.validate.filler import Filler

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_special]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [Filler(7).text(60000), "0123456789 secret code number Reply JSON the three numbers only",
            Filler(11).text(20000)]
    tok.train_from_iterator(text, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=special[1:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return tok.get_vocab()


def make_qwen3(out: Path) -> Path:
    """A 2-layer Qwen3, hidden 64."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = write_tokenizer(out)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"], tie_word_embeddings=True,
                      torch_dtype="bfloat16")
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def qwen4_exp_text_config(vocab: dict[str, int]) -> dict:
    """4 layers (GDN, GDN, GDN, QSA), PLE on layers 1 and 2, 4 experts, 2 hyper-connection streams."""
    return dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu",
        layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, hc_count=2, hc_lowrank=8,
        ple_layer_ids=PLE_LAYER_IDS, ple_embed_dim=64, ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=1000, split_ngram_parts=SPLIT_NGRAM_PARTS,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=2048, indexer_compress_ratio=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"], tie_word_embeddings=False,
    )


def make_qwen4_exp(out: Path, *, copy_bias: float = 0.0) -> Path:
    """The tiny qwen4_exp, in bf16 (sglang offloads only bf16 PLE tables by default).

    It is a vision-language checkpoint like the real one (sglang builds its processor at start), with a
    one-block vision tower that no test feeds.

    ``copy_bias`` (issue 37 item 5) adds that multiple of the input embedding to the output layer
    (``lm_head += copy_bias * embed_tokens``), so the target sometimes repeats the token it has just read: the
    random model never does on its own (0 repeats in the sglang suite's greedy outputs), so ``write_mtp_draft``'s
    repeat draft was never accepted. 0.5 gave 6 repeats in the 48 greedy tokens (transformers, this CPU), none
    longer than a pair; 1.0 already loops on one token. 0 (the default) writes the same bytes as before."""
    import torch
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLVideoProcessor,
        Qwen4ExpConfig,
        Qwen4ExpForConditionalGeneration,
    )

    vocab = write_tokenizer(out, VISION_TOKENS)
    text = qwen4_exp_text_config(vocab)
    cfg = Qwen4ExpConfig(text_config=text, vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 32,
                                                          "num_heads": 2, "out_hidden_size": 64},
                         image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
                         vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"],
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    Qwen2VLImageProcessor().save_pretrained(out)
    Qwen3VLVideoProcessor().save_pretrained(out)
    torch.manual_seed(0)
    model = Qwen4ExpForConditionalGeneration(cfg).to(torch.bfloat16)
    with torch.no_grad():  # transformers leaves some parameters at zero init; give the PLE path real numbers
        for name, p in model.named_parameters():
            if ".ple." in name and p.dim() >= 2 and not p.any():
                p.normal_(0.0, 0.05)
        if copy_bias:
            head = model.lm_head.weight
            embed = model.get_input_embeddings().weight
            head.copy_((head.float() + copy_bias * embed.float()).to(head.dtype))
    model.save_pretrained(out)
    meta = json.loads((out / "config.json").read_text())
    # sglang reads the interval of the full-attention layers; transformers drops it once layer_types is given
    meta["text_config"]["full_attention_interval"] = 4
    (out / "config.json").write_text(json.dumps(meta, indent=1))
    return out


MTP_DIR = "mtp"  # the real checkpoint's draft directory (profiles: --speculative-draft-model-path <snapshot>/mtp)


def write_mtp_draft(model: Path, seed: int = 1, *, repeat_draft: bool = True) -> Path:
    """The NEXTN draft of the tiny qwen4_exp at ``model/mtp``, laid out as the real checkpoint's draft: the
    target's ``config.json`` (sglang rewrites the architecture to ``Qwen4ExpForCausalLMMTP`` for a draft and
    shrinks it to one full-attention layer) and ``mtp.*`` tensors, which transformers' class never writes.

    Names are what ``Qwen3_5ForCausalLMMTP.load_weights`` (inherited by ``Qwen4ExpForCausalLMMTP``) maps:
    ``mtp.X`` -> ``model.X``, ``mtp.fc_*``/``mtp.pre_fc_*`` -> the fusion at the top level. The draft layer is
    a QSA attention layer like the target's layer 3, so its tensors take that layer's shapes; the fusion
    (hyper-connection width 2: ``fc_embedding``, ``fc_hidden``, ``pre_fc_norm_embedding`` [hidden],
    ``pre_fc_norm_hidden`` [2 x hidden]) is new. sglang 0.5.23's draft sets ``ple_layer_ids = []``: the draft has
    no PLE layer, so no PLE tensor is written (the loader would only warn and skip one). Greedy output must not
    depend on the draft.

    ``repeat_draft`` (issue 37 item 5): a random draft's proposals are all rejected (accept rate 0.00 in every
    decode line of both engines), which proves "MTP on equals MTP off" only on the reject path. So the draft is
    made to propose the token the target has just emitted: its layer adds nothing (``o_proj``, every
    ``down_proj`` and ``fc_embedding`` zero, so the hyper-connection streams pass through unchanged),
    ``fc_hidden`` is the identity, and its final mixer is the target's own (copied). It then maps the target's
    multi-stream state at position p (scaled by the ``pre_fc_norm_hidden`` RMSNorm, which the mixer's per-branch
    norm undoes) to the target's sampled stream at p, whose argmax is the token just emitted; it is accepted
    wherever the target repeats a token. In sglang it proposes exactly that token, but the random target never
    repeats one on the suite's prompts (checked by logging the verify step's candidates against the target's
    argmax), so the sglang suite's target is written with ``copy_bias``; the vLLM suite's is not."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    draft = model / MTP_DIR
    draft.mkdir(exist_ok=True)
    for f in model.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, draft / f.name)
    target = {}
    for f in sorted(model.glob("*.safetensors")):
        target.update(load_file(str(f)))
    text = json.loads((model / "config.json").read_text())["text_config"]
    hidden, hc = text["hidden_size"], text["hc_count"]
    qsa_layer = text["layer_types"].index("indexed_attention")
    src = f"model.language_model.layers.{qsa_layer}."
    gen = torch.Generator().manual_seed(seed)

    def like(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 1:  # norms: GemmaRMSNorm scales by 1 + w
            return torch.zeros_like(t)
        return (torch.randn(t.shape, generator=gen) * 0.05).to(t.dtype)

    out = {f"mtp.layers.0.{name[len(src):]}": like(t) for name, t in target.items() if name.startswith(src)}
    mixer = "model.language_model.hyper_connection_mixer."
    out.update({f"mtp.hyper_connection_mixer.{n[len(mixer):]}": like(t) for n, t in target.items()
                if n.startswith(mixer)})
    bf16 = torch.bfloat16
    out["mtp.fc_embedding.weight"] = like(torch.empty(hidden, hidden, dtype=bf16))
    out["mtp.fc_hidden.weight"] = like(torch.empty(hidden, hidden, dtype=bf16))
    out["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden, dtype=bf16)
    out["mtp.pre_fc_norm_hidden.weight"] = torch.zeros(hc * hidden, dtype=bf16)
    if not any(".self_attn.indexer." in n for n in out):
        raise AssertionError("the target's QSA layer has no indexer tensors: the draft layout would be wrong")
    if repeat_draft:
        for name in out:
            if name.startswith("mtp.hyper_connection_mixer."):
                out[name] = target[mixer + name[len("mtp.hyper_connection_mixer."):]].clone()
            elif name == "mtp.fc_hidden.weight":
                out[name] = torch.eye(out[name].shape[0], dtype=out[name].dtype)
            elif name == "mtp.fc_embedding.weight" or name.endswith((".o_proj.weight", ".down_proj.weight")):
                out[name] = torch.zeros_like(out[name])
    save_file(out, str(draft / "model.safetensors"), metadata={"format": "pt"})
    return draft


def profile_inputs(root: Path, corpus: list[str]) -> tuple[Path, Path, list[Path]]:
    """The tiny qwen4_exp, its sidecar and ``corpus`` as one text file per request under ``root``: what the
    ``sidecar profile`` tests feed the CLI."""
    from sglang_ssd_stream.sidecar.build import build_sidecar

    model = make_qwen4_exp(root / "model")
    build_sidecar(model, root / "sidecar", progress=False)
    files = []
    for i, text in enumerate(corpus):
        files.append(root / f"doc{i}.txt")
        files[-1].write_text(text)
    return model, root / "sidecar", files
