"""Tiny random-weight models of every family pipatch supports, built offline from configs.

``tiny_model("llama")`` returns an nnsight ``TransformersModel`` wrapping a 2-layer,
64-wide, float32 model with random weights and an in-memory word-level tokenizer: nothing is
downloaded, and the whole set builds in a few seconds on a laptop CPU.

The tokenizer knows a fixed vocabulary of English words (each both bare and with a leading
space, GPT-2 style ``Ġ`` marking), so prompts such as ``"The Eiffel Tower is in the city of"``
and answers such as ``" Paris"`` / ``" Rome"`` are one token per word, with character offsets.
Unknown words become ``<unk>``. Families whose real tokenizer prepends a BOS token
(Llama, Mistral, Gemma, Phi-3) get one here too, so the engine sees both conventions.
"""

from __future__ import annotations

import functools
import zlib

import torch

__all__ = ["FAMILIES", "SUBLAYER_REFUSED", "VARIANTS", "VOCAB_SIZE", "WORDS", "save_tiny", "tiny_model", "tiny_tokenizer"]

VOCAB_SIZE = 1000
D_MODEL = 64
N_HEADS = 4
N_KV_HEADS = 2  # for the GQA families
HEAD_DIM = D_MODEL // N_HEADS
# Gemma and Qwen3 set head_dim independently of hidden_size (Gemma 3 270M: 4 heads x 256 on a
# 640-wide stream), so their tiny models do too: z is 4 x 32 = 128 wide on a 64-wide stream.
WIDE_HEAD_DIM = 32
N_LAYERS = 3
D_MLP = 128

# Families with a full adapter, in the order tests report them.
FAMILIES = [
    "gemma2",
    "gemma3",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gpt2",
    "gpt_neox",
    "phi3",
    "falcon",
]
# Other layouts of a family above, worth covering: Falcon-40B/180B style (grouped-query
# attention, separate layer norms for attention and MLP, new_decoder_architecture=True).
# Gemma 3 image-text (what AutoModelForCausalLM loads for Gemma 3 4B and up): the language
# model sits at model.language_model, sizes in config.text_config.
VARIANTS = ["falcon_new", "gemma3_mm"]
# Families whose attention / MLP modules add the residual themselves: only site="resid" works.
SUBLAYER_REFUSED = ["bloom"]

_SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>"]
_ADDS_BOS = {"gemma2", "gemma3", "gemma3_mm", "llama", "mistral", "phi3"}

WORDS = """
The the A a An an Eiffel Tower is in city of Paris Rome London Berlin Madrid Tokyo Moscow
Colosseum Big Ben Brandenburg Gate Kremlin located capital France Italy England Germany Spain
Japan Russia country which where was were are be has have had and or not to for on at by with
from as it its this that these those he she they his her their him them I you we me my your
John Mary Tom Anna Alice Bob went gave give a an book ball store school park home office
store hospital kitchen When Then After Before then after before said told asked loved hated
good bad big small new old first last one two three four five six seven eight nine ten
red blue green yellow black white cat dog bird fish apple banana orange water fire earth
language speaks speak French Italian English German Spanish Japanese Russian people famous
known for named called president king queen born died lives lived plays played sport
football basketball tennis piano guitar Apple Google Microsoft company founded by CEO
day night year time man woman child friend mother father brother sister
""".split()  # noqa: SIM905 - a word list reads better as text
_PUNCT = [".", ",", "!", "?", ":", ";", "'", '"', "-", "(", ")", "\n"]


@functools.cache
def _vocab() -> dict[str, int]:
    tokens: list[str] = list(_SPECIALS)
    seen = set(tokens)
    for word in list(dict.fromkeys(WORDS)) + _PUNCT:
        for tok in (word, "Ġ" + word):
            tok = tok.replace("\n", "Ċ")
            if tok not in seen:
                seen.add(tok)
                tokens.append(tok)
    # Pad to VOCAB_SIZE so len(tokenizer) == the model's vocab_size, as with real checkpoints.
    tokens += [f"<w{i}>" for i in range(VOCAB_SIZE - len(tokens))]
    assert len(tokens) == VOCAB_SIZE, len(tokens)
    return {tok: i for i, tok in enumerate(tokens)}


def _backend(add_bos: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = _vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # GPT-2's byte-level pre-tokenizer: " Paris" -> "ĠParis", offsets into the original text.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Offsets cover the word without its leading space, as GPT-2's tokenizer reports them.
    post = [processors.ByteLevel(trim_offsets=True)]
    if add_bos:
        post.append(
            processors.TemplateProcessing(
                single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", vocab["<bos>"])]
            )
        )
    tok.post_processor = processors.Sequence(post)
    return tok


def tiny_tokenizer(add_bos: bool = False):
    """A ``PreTrainedTokenizerFast`` over the fixed word vocabulary (offsets supported)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=_backend(add_bos),
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        model_max_length=128,
    )


def _ids() -> dict:
    v = _vocab()
    return {"pad_token_id": v["<pad>"], "bos_token_id": v["<bos>"], "eos_token_id": v["<eos>"]}


def _config(family: str):
    import transformers as T

    common = dict(vocab_size=VOCAB_SIZE, max_position_embeddings=128, **_ids())
    llama_like = dict(
        hidden_size=D_MODEL,
        intermediate_size=D_MLP,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        attention_dropout=0.0,
        **common,
    )
    if family == "gemma2":
        return T.Gemma2Config(
            **llama_like,
            num_key_value_heads=N_KV_HEADS,
            head_dim=WIDE_HEAD_DIM,
            query_pre_attn_scalar=WIDE_HEAD_DIM,
            sliding_window=4,  # exercise the sliding layers on short prompts
            # A full final layer: with a sliding one the last position could not see the
            # subject from layer 1 on, and patching there would change nothing.
            layer_types=["full_attention", "sliding_attention", "full_attention"][:N_LAYERS],
            # Real Gemma 2 caps at 30; random tiny logits are ~0.5, so cap at 1 to make the
            # cap bite (a logits() that forgot it would be off by ~0.1, not ~1e-7).
            final_logit_softcapping=1.0,
            attn_logit_softcapping=50.0,
        )
    if family == "gemma3":
        return T.Gemma3TextConfig(
            **llama_like,
            num_key_value_heads=N_KV_HEADS,
            head_dim=WIDE_HEAD_DIM,
            query_pre_attn_scalar=WIDE_HEAD_DIM,
            sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"][:N_LAYERS],
        )
    if family == "llama":
        return T.LlamaConfig(**llama_like, num_key_value_heads=N_KV_HEADS)
    if family == "mistral":
        return T.MistralConfig(**llama_like, num_key_value_heads=N_KV_HEADS, sliding_window=None)
    if family == "qwen2":
        return T.Qwen2Config(**llama_like, num_key_value_heads=N_KV_HEADS)
    if family == "qwen3":
        return T.Qwen3Config(**llama_like, num_key_value_heads=N_KV_HEADS, head_dim=WIDE_HEAD_DIM)
    if family == "phi3":
        return T.Phi3Config(**llama_like, num_key_value_heads=N_KV_HEADS, resid_pdrop=0.0, embd_pdrop=0.0)
    if family == "gpt2":
        return T.GPT2Config(
            vocab_size=VOCAB_SIZE,
            n_positions=128,
            n_embd=D_MODEL,
            n_layer=N_LAYERS,
            n_head=N_HEADS,
            n_inner=D_MLP,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            summary_first_dropout=0.0,
            **_ids(),
        )
    if family == "gpt_neox":
        return T.GPTNeoXConfig(
            hidden_size=D_MODEL,
            intermediate_size=D_MLP,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=N_HEADS,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            use_parallel_residual=True,
            **common,
        )
    if family == "falcon":
        # Falcon-7B layout: multi-query attention, attention and MLP in parallel off one norm.
        return T.FalconConfig(
            hidden_size=D_MODEL,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=N_HEADS,
            ffn_hidden_size=D_MLP,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            multi_query=True,
            parallel_attn=True,
            new_decoder_architecture=False,
            **common,
        )
    if family == "gemma3_mm":
        # A one-layer 28-pixel SigLIP tower; text-only prompts never run it. The image
        # special tokens are filler ids no test prompt uses.
        return T.Gemma3Config(
            text_config=_config("gemma3").to_dict(),
            vision_config={
                "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
            },
            mm_tokens_per_image=4,
            boi_token_index=VOCAB_SIZE - 3,
            eoi_token_index=VOCAB_SIZE - 2,
            image_token_index=VOCAB_SIZE - 1,
            **_ids(),
        )
    if family == "falcon_new":
        return T.FalconConfig(
            hidden_size=D_MODEL,
            num_hidden_layers=N_LAYERS,
            num_attention_heads=N_HEADS,
            num_kv_heads=N_KV_HEADS,
            ffn_hidden_size=D_MLP,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            new_decoder_architecture=True,
            parallel_attn=True,
            num_ln_in_parallel_attn=2,
            **common,
        )
    if family == "bloom":
        return T.BloomConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=D_MODEL,
            n_layer=N_LAYERS,
            n_head=N_HEADS,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **_ids(),
        )
    raise ValueError(f"unknown tiny family {family!r}; known: {FAMILIES + VARIANTS + SUBLAYER_REFUSED}")


_CLASSES = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gpt_neox": "GPTNeoXForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "falcon": "FalconForCausalLM",
    "falcon_new": "FalconForCausalLM",
    "gemma3_mm": "Gemma3ForConditionalGeneration",
    "bloom": "BloomForCausalLM",
}


def tiny_hf_model(family: str, seed: int = 0):
    """The plain transformers model (random weights, eval mode, float32, eager attention)."""
    import transformers as T

    config = _config(family)
    config._attn_implementation = "eager"
    # Seeded per family too, so same-architecture families (Llama, Mistral) differ.
    torch.manual_seed(zlib.crc32(f"{family}:{seed}".encode()))
    model = getattr(T, _CLASSES[family])(config)
    model = model.to(torch.float32).eval()
    model.name_or_path = f"tiny-{family}"
    return model


def tiny_model(family: str, seed: int = 0):
    """A tiny random ``family`` model wrapped as nnsight ``TransformersModel``.

    Same ``family`` and ``seed`` give the same weights. Supported: :data:`FAMILIES`, :data:`VARIANTS` and
    :data:`SUBLAYER_REFUSED`.
    """
    from nnsight.modeling.transformers import TransformersModel

    hf = tiny_hf_model(family, seed)
    tokenizer = tiny_tokenizer(add_bos=family in _ADDS_BOS)
    from pipatch._base.known import remember

    return remember(TransformersModel(hf, tokenizer=tokenizer), name=f"tiny-{family}")


def save_tiny(family: str, path):
    """Save the tiny ``family`` checkpoint (weights and tokenizer files) into the folder ``path``:
    what ``pipatch.load_model(path)`` and ``--model PATH`` read, in another process too."""
    tiny_hf_model(family).save_pretrained(path)
    tiny_tokenizer(add_bos=family in _ADDS_BOS).save_pretrained(path)
    return path
