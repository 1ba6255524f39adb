"""Qwen 3.5 with its vision encoder as transformers 5.24's ``Qwen3_5ForConditionalGeneration``
(``qwen3_5``): the language model under ``model.language_model`` (``lm_head`` beside it), KerasHub's
``Qwen3_5VisionEncoder`` (its Conv3D patch embedding, position table, blocks with a fused qkv,
and the 2 x 2 patch merger into the language model) as ``model.visual``.

What a user of the export must know (``tests/test_hf_export_qwen3_5_vision.py`` checks the
logits from the same pixel values and from transformers' image processor's):

- both encoders read an image's patches by 2 x 2 merge window (their position embeddings and
  rotary positions, the merger's groups of 4), as transformers' ``Qwen2VLImageProcessor`` lists
  them ([3, T, patch, patch] each). KerasHub 0.32's ``Qwen3_5ImageConverter`` lists them row by
  row ([T, patch, patch, 3] each); this package's data reorders its list by window
  (``data.images.qwen_window_order``), so a picture through transformers' processor reaches the
  export in the order this package trained it on;
- transformers computes the multimodal rotary positions itself (``get_rope_index``, from
  ``mm_token_type_ids``), as this package's forward does.
"""

from __future__ import annotations

from nnx_posttrain.families.base import language_model

_DENSE = ((1,), (0,))  # a Dense kernel [in, out] as [out, in]
_E = r"qwen3_5_vision_encoder(?:_\d+)?"
_V, _B = "model.visual", r"blocks_(\d+)"
_NORMS = {"gamma": "weight", "beta": "bias"}
_LINEARS = {"attn/qkv": "attn.qkv", "attn/proj": "attn.proj", "mlp/fc1": "mlp.linear_fc1",
            "mlp/fc2": "mlp.linear_fc2"}

VISION_RULES = [
    (rf"{_E}/patch_embed/proj/kernel", _V + ".patch_embed.proj.weight",
     ("transpose", (4, 3, 0, 1, 2))),  # [T, p, p, 3, width] as PyTorch's Conv3d [width, 3, T, p, p]
    (rf"{_E}/patch_embed/proj/bias", _V + ".patch_embed.proj.bias", None),
    (rf"{_E}/pos_embed/embeddings", _V + ".pos_embed.weight", None),
    *[(rf"{_E}/{_B}/{norm}/{ours}", f"{_V}.blocks.{{}}.{norm}.{theirs}", None)
      for norm in ("norm1", "norm2") for ours, theirs in _NORMS.items()],
    *[(rf"{_E}/{_B}/{ours}/kernel", f"{_V}.blocks.{{}}.{theirs}.weight", _DENSE)
      for ours, theirs in _LINEARS.items()],
    *[(rf"{_E}/{_B}/{ours}/bias", f"{_V}.blocks.{{}}.{theirs}.bias", None)
      for ours, theirs in _LINEARS.items()],
    *[(rf"{_E}/merger/ln_q/{ours}", f"{_V}.merger.norm.{theirs}", None)
      for ours, theirs in _NORMS.items()],
    *[(rf"{_E}/merger/mlp_{i}/kernel", f"{_V}.merger.linear_fc{j}.weight", _DENSE)
      for i, j in ((0, 1), (2, 2))],
    *[(rf"{_E}/merger/mlp_{i}/bias", f"{_V}.merger.linear_fc{j}.bias", None)
      for i, j in ((0, 1), (2, 2))],
]


def rules(text_rules: list) -> list:
    return language_model(text_rules) + VISION_RULES


def config(b, text: dict) -> dict:
    """``qwen3_5``: the text config ``text`` (``qwen3_5_text``) with the M-RoPE sections in its
    rotary parameters, the vision config of KerasHub's encoder; the image token ids are the
    tokenizer's (``Export.image_tokens``)."""
    enc = b.vision_encoder
    rope = dict(text["rope_parameters"], mrope_section=list(b.mrope_section),
                mrope_interleaved=True)
    vision = dict(model_type="qwen3_5_vision", depth=enc.depth, hidden_size=enc.hidden_size,
                  num_heads=enc.num_heads, intermediate_size=enc.intermediate_size,
                  in_channels=enc.in_channels, patch_size=enc.patch_size,
                  temporal_patch_size=enc.temporal_patch_size,
                  spatial_merge_size=enc.spatial_merge_size, out_hidden_size=enc.out_hidden_size,
                  num_position_embeddings=enc.num_position_embeddings,
                  hidden_act="gelu_pytorch_tanh")
    text = {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype", "dtype")}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": dict(text, rope_parameters=rope), "vision_config": vision,
            "tie_word_embeddings": b.tie_word_embeddings}
