"""Export a decoderlab checkpoint to one GGUF file, the format llama.cpp and Ollama run.

    python -m decoderlab.convert --to gguf SRC OUT.gguf [--outtype f32|f16|bf16|q8_0]

or from Python, ``convert_to_gguf(src, out, outtype)``. Written with the ``gguf`` library (the format's
reference writer, ``pip install decoderlab[export]``) under one of llama.cpp's architectures: ``qwen3`` for a
model with QK-norm (the default recipe's), ``llama`` otherwise; with its tensor names
(``gguf.get_tensor_name_map``; QK-norm's weights are ``attn_q_norm`` / ``attn_k_norm``) and metadata keys, the
tokenizer included.

What exports: every configuration ``--to qwen3`` (QK-norm) or ``--to llama`` (no QK-norm) accepts
(``qwen3_config_from_decoderlab`` / ``llama_config_from_decoderlab`` refuse the rest, field by field), less what
llama.cpp's graph or transformers' GGUF loader cannot read back from the file (``gguf_blockers``): a non-SiLU
MLP, scaled RoPE, biases, sliding layers.

Per-layer layouts: neither llama.cpp's ``llama`` and ``qwen3`` graphs nor transformers' GGUF loader for those two
architectures reads a sliding window, a per-layer RoPE switch or attention sinks from the file (llama.cpp keeps those
for other architectures: Gemma's windows, SmolLM3's every fourth layer without RoPE, gpt-oss's sinks, each with its
own blocks), so a file would compute another model: Llama and Qwen3 refuse RoPE-free layers and sinks already, and
the sliding layers that ``--to qwen3`` keeps are refused here, each naming its layers.

RoPE layout: decoderlab, like HF Llama and HF Qwen3, rotates the two halves of each head (``rotate_half``).
llama.cpp's ``qwen3`` graph does too (its NEOX rope type), so those rows go as they are. Its ``llama`` graph
rotates adjacent pairs, Meta's original layout (Su et al. 2021 write it that way): there the rows of each head
of q_proj and k_proj are reordered (``interleave_rope_rows``), as llama.cpp's own HF converter does, and
transformers' GGUF loader reorders them back.

Tokenizer: GGUF's byte-level BPE (``tokenizer.ggml.model = "gpt2"``, GPT-2's pre-tokenizer ``"gpt-2"``),
which both readers rebuild with the same ids, carries
- byte-level BPE tokenizers with GPT-2's split (the training scripts' BPE, GPT-2's own): vocabulary and
  merges as they are;
- one-token-per-character tokenizers (the scripts' char tokenizer): every character is one byte and one
  token, so they become a byte-level BPE without merges, the characters spelled in GPT-2's byte alphabet;
  this needs every character to be ASCII.
Added tokens keep their ids (special ones become llama.cpp CONTROL tokens); a model vocabulary larger
than the tokenizer's is padded with unused ``[PAD<id>]`` tokens, as llama.cpp's converter pads.

The file is written to a temporary name beside OUT and renamed at the end, one tensor at a time (peak
memory: one tensor, beyond the memory-mapped source): a failed export leaves nothing behind.
"""

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedConfig, PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from ..configuration_decoderlab import DecoderLabConfig
from .checkpoint import CheckpointReader, resolve_source
from .families import (
    TO_LLAMA,
    TO_QWEN3,
    Conversion,
    fold,
    llama_config_from_decoderlab,
    make_skeleton,
    name_layers,
    plan_tensors,
    qwen3_config_from_decoderlab,
    read_source_config,
    refuse_fields,
    sliding_layers,
)

logger = logging.getLogger(__name__)

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5  # llama.cpp's token types


def _gguf():
    """The ``gguf`` library, or an ImportError saying how to install it."""
    try:
        import gguf
    except ImportError as err:
        raise ImportError(
            "GGUF export needs the gguf library: pip install 'decoderlab[export]' (or pip install gguf)."
        ) from err
    return gguf


# ----------------------------------------------------------------------------------------------
# What a GGUF file can say


def target_config(config: DecoderLabConfig) -> tuple[Conversion, PreTrainedConfig]:
    """The family a GGUF file describes ``config`` as: Qwen3 with QK-norm, else Llama (llama.cpp has both
    graphs); its Conversion names the tensors. Raises the family's field-by-field ValueError."""
    if config.qk_norm:
        return TO_QWEN3, qwen3_config_from_decoderlab(config)
    return TO_LLAMA, llama_config_from_decoderlab(config)


def gguf_blockers(target: PreTrainedConfig) -> None:
    """A ValueError listing what llama.cpp's ``llama`` / ``qwen3`` graph or transformers' GGUF loader would not
    read back from the file, for a config ``target_config`` already accepted."""
    family, flag = target.model_type.capitalize(), f"--to {target.model_type}"
    rope_type = (target.rope_parameters or {}).get("rope_type", "default")
    no_biases = f"transformers' GGUF loader builds {family} without biases (False)"
    sliding = sliding_layers(getattr(target, "layer_types", None) or [])  # Qwen3's; Llama has refused them already
    in_the_way = {
        "layer_types": (
            bool(sliding),
            f"{name_layers(sliding)} {'is' if len(sliding) == 1 else 'are'} 'sliding_attention' (sliding_window="
            f"{getattr(target, 'sliding_window', None)}), but llama.cpp's "
            f"{target.model_type} graph and transformers' GGUF loader read no window for {target.model_type} files: "
            "both would attend to every earlier token in every layer",
        ),
        "hidden_act": (target.hidden_act != "silu", f"llama.cpp's {family} MLP gates with SiLU ('silu')"),
        "rope_parameters['rope_type']": (
            rope_type != "default",
            "this export writes unscaled RoPE ('default'); transformers' GGUF loader reads no RoPE scaling",
        ),
        "attention_bias": (target.attention_bias, no_biases),
        "mlp_bias": (getattr(target, "mlp_bias", False), no_biases),  # Qwen3Config has none: already refused
    }
    refuse_fields(
        in_the_way,
        target,
        {"rope_parameters['rope_type']": rope_type},
        f"This configuration exports to {family} but not to GGUF",
        f"Export it with {flag} instead (a Hugging Face checkpoint that needs no remote code).",
    )


@dataclass
class GGUFVocab:
    """A tokenizer as GGUF's byte-level BPE: token texts by id, their llama.cpp types, merges, special ids."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    special_ids: dict[str, int]  # "bos", "eos", "unk", "pad" -> id
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def _byte_level_bpe_problems(spec: dict) -> list[str]:
    """Why a BPE ``tokenizer.json`` is not GPT-2's byte-level scheme (llama.cpp's "gpt-2" pre-tokenizer)."""
    pre, model = spec.get("pre_tokenizer") or {}, spec["model"]
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 1:
        pre = pre["pretokenizers"][0]
    problems = []
    if not (pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")):
        problems.append(
            f"pre-tokenizer {json.dumps(pre)[:200]} (GGUF's 'gpt-2' is ByteLevel, GPT-2's split, no prefix space)"
        )
    for flag in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(flag):
            problems.append(f"BPE {flag}={model[flag]!r}")
    for flag in ("byte_fallback", "ignore_merges"):
        if model.get(flag):
            problems.append(f"BPE {flag}=True")
    return problems


def gguf_vocab(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> GGUFVocab:
    """``tokenizer`` as GGUF's byte-level BPE with the same ids, or a ValueError saying why it cannot be."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"GGUF export reads a fast tokenizer (tokenizer.json); got {type(tokenizer).__name__}.")
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model, problems = spec["model"], []
    if spec.get("normalizer"):
        problems.append(f"normalizer {json.dumps(spec['normalizer'])[:200]} (GGUF's byte-level BPE has none)")
    added = {token.content: token for token in tokenizer.added_tokens_decoder.values()}
    spelling = bytes_to_unicode()  # byte -> the character GPT-2's byte alphabet writes it as
    if model["type"] == "BPE":
        problems += _byte_level_bpe_problems(spec)
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]  # both tokenizers formats
        respell = lambda text: text  # noqa: E731  (already in the byte alphabet)
    elif model["type"] == "WordLevel" and all(len(t) == 1 or t in added for t in model["vocab"]):
        # the special tokens (<|endoftext|>, <|unk|>) sit in the vocabulary too, and keep their ids as added tokens
        wide = sorted(t for t in model["vocab"] if len(t) == 1 and ord(t) >= 128)
        if wide:
            problems.append(
                f"characters outside ASCII {wide[:10]}: a character tokenizer becomes a byte-level BPE "
                "without merges, where only a one-byte character is one token"
            )
        merges = []
        respell = lambda text: spelling[ord(text)] if ord(text) < 128 else text  # noqa: E731
    else:
        problems.append(
            f"a {model['type']} model (GGUF export carries byte-level BPE and one-token-per-character tokenizers)"
        )
    if problems:
        raise ValueError(
            "This tokenizer cannot be written as GGUF's byte-level BPE with the same token ids:\n  "
            + "\n  ".join(problems)
        )
    by_id = {i: text for text, i in tokenizer.get_vocab().items()}
    if len(by_id) > vocab_size:
        raise ValueError(
            f"The tokenizer has {len(by_id)} tokens but the model embeds only vocab_size={vocab_size}; "
            "export the tokenizer the model was trained with."
        )
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError(f"The tokenizer's ids are not 0..{len(by_id) - 1} without gaps; GGUF lists tokens by id.")
    tokens, types = [], []
    for i in range(vocab_size):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
        elif text in added:
            tokens.append(text)
            types.append(TOKEN_CONTROL if added[text].special else TOKEN_USER_DEFINED)
        else:
            tokens.append(respell(text))
            types.append(TOKEN_NORMAL)
    specials = {
        key: getattr(tokenizer, f"{name}_token_id")
        for key, name in (("bos", "bos"), ("eos", "eos"), ("unk", "unk"), ("pad", "pad"))
    }
    # what the tokenizer adds around a text: nothing, BOS before, EOS after, or both
    around = tokenizer("")["input_ids"]
    add_bos = bool(around) and around[0] == specials["bos"]
    add_eos = bool(around) and around[-1] == specials["eos"] and len(around) == 1 + add_bos
    if len(around) != add_bos + add_eos:
        raise ValueError(
            f"The tokenizer adds {tokenizer.convert_ids_to_tokens(around)} around each text; GGUF can say "
            "only 'add BOS' and 'add EOS'."
        )
    template = getattr(tokenizer, "chat_template", None)
    return GGUFVocab(
        tokens=tokens,
        types=types,
        merges=merges,
        special_ids={key: i for key, i in specials.items() if i is not None},
        add_bos=add_bos,
        add_eos=add_eos,
        chat_template=template if isinstance(template, str) else None,
    )


# ----------------------------------------------------------------------------------------------
# Tensors


def interleave_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """q_proj / k_proj rows from HF's half-split RoPE layout to llama.cpp's adjacent pairs: within each head,
    output row 2i is input row i and row 2i+1 is row i + head_dim/2."""
    rows = weight.shape[0]
    halves = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])  # (nh, 2, hs/2, ...)
    return halves.transpose(1, 2).reshape(weight.shape)  # (nh, hs/2, 2, ...) flattened back


def storage_type(gguf, shape: tuple[int, ...], outtype: str):
    """How one tensor is stored: vectors (norm weights) stay float32, as llama.cpp's converter keeps them;
    a matrix whose rows do not split into Q8_0's blocks of 32 falls back to float16, as it does."""
    T = gguf.GGMLQuantizationType
    if len(shape) == 1 or outtype == "f32":
        return T.F32
    if outtype == "q8_0" and shape[-1] % gguf.GGML_QUANT_SIZES[T.Q8_0][0] == 0:
        return T.Q8_0
    return T.BF16 if outtype == "bf16" else T.F16


FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}


def write_metadata(writer, gguf, hf: PreTrainedConfig, vocab: GGUFVocab, name: str, outtype: str) -> None:
    """hf.cpp's keys for ``hf`` (a LlamaConfig or Qwen3Config: the two read the same keys)."""
    writer.add_name(name)
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[outtype]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(hf.vocab_size)
    writer.add_context_length(hf.max_position_embeddings)
    writer.add_embedding_length(hf.hidden_size)
    writer.add_block_count(hf.num_hidden_layers)
    writer.add_feed_forward_length(hf.intermediate_size)
    writer.add_head_count(hf.num_attention_heads)
    writer.add_head_count_kv(hf.num_key_value_heads)
    writer.add_key_length(hf.head_dim)
    writer.add_value_length(hf.head_dim)
    writer.add_rope_dimension_count(hf.head_dim)  # every dimension rotates (partial rotary is refused)
    writer.add_rope_freq_base(hf.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(hf.rms_norm_eps)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    # hf.cpp requires the merges key; gguf's writer skips an empty list, so a merge-less one is added raw
    string = gguf.GGUFValueType.STRING
    writer.add_key_value(gguf.Keys.Tokenizer.MERGES, vocab.merges, gguf.GGUFValueType.ARRAY, sub_type=string)
    for key, token_id in vocab.special_ids.items():
        getattr(writer, f"add_{key}_token_id")(token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)


def _empty_array_writer(gguf):
    """gguf's GGUFWriter, able to write an empty array (a character tokenizer has no merges), which the
    format allows and its writer refuses."""

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if vtype == gguf.GGUFValueType.ARRAY and len(val) == 0 and sub_type is not None:
                return (self._pack("I", vtype) if add_vtype else b"") + self._pack("I", sub_type) + self._pack("Q", 0)
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer


# ----------------------------------------------------------------------------------------------
# The export


def prepare_output(out: str | os.PathLike) -> Path:
    out = Path(out)
    if out.is_dir():
        raise ValueError(
            f"OUT {str(out)!r} is a folder; give the path of the .gguf file to write, e.g. {out / 'model.gguf'}."
        )
    if out.suffix != ".gguf":
        raise ValueError(f"OUT {str(out)!r} should end in .gguf for --to gguf; name the file, e.g. model.gguf.")
    if out.exists():
        raise ValueError(f"OUT {str(out)!r} exists; choose a new file name (nothing is overwritten).")
    if not out.parent.is_dir():
        raise ValueError(f"The folder of OUT, {str(out.parent)!r}, does not exist; create it first.")
    return out


def load_source_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(
            f"No tokenizer.json in {folder}: a GGUF file carries its tokenizer. Save the tokenizer the model was "
            "trained with into the checkpoint (tokenizer.save_pretrained) and export again."
        )
    return AutoTokenizer.from_pretrained(folder)


def convert_to_gguf(src: str | os.PathLike, out: str | os.PathLike, outtype: str = "f32") -> Path:
    """A decoderlab checkpoint in SRC (folder or Hub repo id) -> the new GGUF file OUT (hf.cpp's ``qwen3``
    architecture with QK-norm, else ``llama``; tokenizer included), its matrices stored as ``outtype``. Returns OUT.

    Raises ValueError, before anything is written, for an unknown ``outtype``, an OUT that exists or whose
    folder does not, a SRC that is not decoderlab, a configuration Qwen3 / Llama or GGUF cannot express (every
    field named), or a tokenizer GGUF cannot carry with the same ids."""
    if outtype not in OUTTYPES:
        raise ValueError(f"Unknown outtype {outtype!r}; choose one of {', '.join(map(repr, OUTTYPES))}.")
    out = prepare_output(out)
    gguf = _gguf()
    src_dir = resolve_source(src)
    config = read_source_config(src_dir, TO_LLAMA, "--to gguf")
    conversion, hf = target_config(config)
    gguf_blockers(hf)
    folds = conversion.folds(config)  # muP's multipliers, into the weights (families.mup_folds)
    vocab = gguf_vocab(load_source_tokenizer(src_dir), hf.vocab_size)
    arch = gguf.MODEL_ARCH.QWEN3 if hf.model_type == "qwen3" else gguf.MODEL_ARCH.LLAMA
    arch_name = gguf.MODEL_ARCH_NAMES[arch]  # "qwen3", "llama"
    names = gguf.get_tensor_name_map(arch, hf.num_hidden_layers)
    heads = {"q_proj": hf.num_attention_heads, "k_proj": hf.num_key_value_heads}
    # llama's graph rotates adjacent pairs (interleave_rope_rows); qwen3's rotates the two halves, as decoderlab
    interleaved = arch == gguf.MODEL_ARCH.LLAMA

    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = None
    try:
        with CheckpointReader(src_dir) as reader:
            skeleton = make_skeleton(conversion.target_model, hf, torch.float32)
            plan, shapes = plan_tensors(reader, conversion, skeleton), skeleton.state_dict()
            tensors = {}  # GGUF name -> (source name, shape, storage type), in writing order
            for source, targets in plan.items():
                for target in targets:
                    gguf_name = names.get_name(target, try_suffixes=(".weight", ".bias"))
                    if gguf_name is None:
                        raise ValueError(f"llama.cpp's {arch_name} architecture has no tensor for {target!r}.")
                    shape = tuple(shapes[target].shape)
                    tensors[gguf_name] = (source, shape, storage_type(gguf, shape, outtype))
            writer = _empty_array_writer(gguf)(tmp, arch=arch_name)
            write_metadata(writer, gguf, hf, vocab, src_dir.name, outtype)
            for gguf_name, (_, shape, qtype) in tensors.items():
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                nbytes = math.prod(shape[:-1]) * shape[-1] // block * type_size
                writer.add_tensor_info(gguf_name, shape, np.float32, nbytes, raw_dtype=qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for source, _, qtype in tensors.values():  # (out, in) rows, as GGUF stores them
                tensor = fold(source, reader[source].to(torch.float32), folds)
                projection = source.rsplit(".", 2)[-2]
                if interleaved and projection in heads:
                    tensor = interleave_rope_rows(tensor, heads[projection])
                writer.write_tensor_data(gguf.quants.quantize(tensor.numpy(), qtype))
        writer.close()
        os.replace(tmp, out)
    finally:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
    logger.info(
        f"Wrote {out} ({out.stat().st_size / 1e6:.1f} MB, {arch_name}, {outtype}, {len(tensors)} tensors, "
        f"{len(vocab.tokens)} tokens{', tied embeddings' if hf.tie_word_embeddings else ''})."
    )
    return out
