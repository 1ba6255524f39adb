"""Gemma 4 with its vision encoder as transformers 5.24's ``Gemma4ForConditionalGeneration``
(``gemma4``): the language model under ``model.language_model``, KerasHub's
``Gemma4VisionEncoder`` (patch embedder, encoder blocks with clipped linears, pooling) as
``model.vision_tower`` and its projection into the language model as ``model.embed_vision``.

What transformers computes differently from KerasHub, and so what the export refuses or what its
users must know (``tests/test_hf_export_vision.py`` checks the logits):

- transformers' image processor gives an image as many soft tokens as its pooled grid has real
  cells (``num_soft_tokens_per_image``) and its processor writes that many placeholders; KerasHub's
  preprocessor (and so this project's data pipeline) writes ``max_soft_tokens`` placeholders for
  every image, the cells beyond the image's grid reading a zero embedding. The two agree for an
  image whose pooled grid fills ``max_soft_tokens``;
- transformers pools each image on its own grid; KerasHub on the widest image of the call.
"""

from __future__ import annotations

from nnx_posttrain.families.base import language_model, refuse

_DENSE = ((1,), (0,))  # a Dense kernel [in, out] as [out, in]
_T = "model.vision_tower"
_B, _HB = r"image_encoder/encoder_block_(\d+)", _T + ".encoder.layers.{}"
# the encoder block's clipped linears: KerasHub's wrapper name -> transformers' module
_LINEARS = {"attention/query": "self_attn.q_proj", "attention/key": "self_attn.k_proj",
            "attention/value": "self_attn.v_proj", "attention/attention_output": "self_attn.o_proj",
            "ffw_gating": "mlp.gate_proj", "ffw_gating_2": "mlp.up_proj",
            "ffw_linear": "mlp.down_proj"}
_KERNELS = {"attention/query": ((0, 2), (1,)), "attention/key": ((0, 2), (1,)),
            "attention/value": ((0, 2), (1,)), "attention/attention_output": ((2,), (0, 1))}
_NORMS = {"pre_attention_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
          "pre_ffw_norm": "pre_feedforward_layernorm",
          "post_ffw_norm": "post_feedforward_layernorm",
          "attention/query_norm": "self_attn.q_norm", "attention/key_norm": "self_attn.k_norm"}

VISION_RULES = [
    (r"patch_embedder/position_embedding_table",
     _T + ".patch_embedder.position_embedding_table", None),
    (r"image_encoder/patch_embedder/input_proj/kernel", _T + ".patch_embedder.input_proj.weight",
     _DENSE),
    *[(rf"{_B}/{ours}/scale", f"{_HB}.{theirs}.weight", None) for ours, theirs in _NORMS.items()],
    *[(rf"{_B}/{ours}/dense/kernel", f"{_HB}.{theirs}.linear.weight", _KERNELS.get(ours, _DENSE))
      for ours, theirs in _LINEARS.items()],
    *[(rf"{_B}/{ours}/{bound}", f"{_HB}.{theirs}.{bound}", None)
      for ours, theirs in _LINEARS.items()
      for bound in ("input_min", "input_max", "output_min", "output_max")],
    (r"vision_output_encoder/vision_input_projection/kernel",
     "model.embed_vision.embedding_projection.weight", _DENSE),
    (r"vision_output_encoder/std_(bias|scale)", _T + ".std_{}", None),
]


def rules(text_rules: list) -> list:
    """The text model's rules under ``model.language_model``, and the vision tower's."""
    return language_model(text_rules) + VISION_RULES


def config(b, text: dict) -> dict:
    """``gemma4``: the text config ``text`` (``gemma4_text``, as ``families.gemma4.config`` writes
    it) under ``text_config``, KerasHub's vision config with transformers' axial rotary type, the
    soft tokens per image; the image token ids are the tokenizer's (``Export.image_tokens``)."""
    from keras_hub.src.utils.transformers.export.gemma4 import get_gemma4_config

    encoder = b.vision_encoder
    refuse("Gemma4Backbone with a vision encoder", [p for p, bad in (
        (f"the projection's norm epsilon differs from the tower's {encoder.layer_norm_epsilon}",
         encoder.get_layer("vision_output_encoder").layer_norm_epsilon
         != encoder.layer_norm_epsilon),
        (f"vision head dim {encoder.head_dim} not divisible by 4 (transformers' axial rotary)",
         encoder.head_dim % 4),
    ) if bad])
    cfg = get_gemma4_config(b, include_lm_head=True)
    vision = dict(cfg["vision_config"], hidden_activation="gelu_pytorch_tanh",
                  attention_dropout=0.0, attention_bias=False,
                  rope_parameters={"rope_type": "axial",
                                   "rope_theta": float(encoder.rope_max_wavelength)})
    text = {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype", "dtype")}
    text["use_bidirectional_attention"] = "vision" if b.use_vision_bidirectional_attention else None
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
            "text_config": dict(text, model_type="gemma4_text"), "vision_config": vision,
            "audio_config": None, "tie_word_embeddings": True, "initializer_range": 0.02}
