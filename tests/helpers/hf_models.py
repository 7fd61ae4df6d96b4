"""Hugging Face models as a user brings them: ``module:factory`` workloads, no autoplace code.

Model families whose graphs torch.fx cannot trace (autoplace captures them with
torch.export): GPT-2 (tied input and output embeddings), BERT (an attention mask input,
indexing by tensors), T5 (encoder-decoder, an optional input left ``None``, tied
embeddings), Llama (rotary embeddings, grouped-query attention, RMSNorm, SwiGLU), Mixtral
(Llama's attention with a top-2 mixture of experts in every layer: routing by the data)
and ViT (image patches, a class token). Defaults are small, for CPU tests; ``scripts/bench/bench_plans.py``'s ``hf-*``
scenarios pass GPT-2 small / BERT-base / T5-small sizes. ``dropout`` defaults to 0 so that
a plan's losses can be compared with the unpartitioned model's exactly. Named
``tests.helpers.hf_models:gpt2`` with the repository root on ``PYTHONPATH`` (the executor's
worker processes import it too), as ``tests/capture/test_hf_models.py`` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

from autoplace.workloads import Workload


def _lm_loss(out, target):
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1))


def _class_loss(out, target):
    return F.cross_entropy(out.logits.float(), target)


def _causal_lm_batch(vocab, seq):
    def make_batch(bs, device):
        ids = torch.randint(0, vocab, (bs, seq + 1), device=device)
        return (ids[:, :-1],), ids[:, 1:]

    return make_batch


def _workload(name, model, make_batch, loss_fn, batch_size, lr, autocast_dtype):
    return Workload(name=name, model=model, make_batch=make_batch, loss_fn=loss_fn,
                    batch_size=batch_size, lr=lr, autocast_dtype=autocast_dtype)


def gpt2(batch_size: int = 8, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4,
         vocab: int = 512, dropout: float = 0.0, lr: float = 1e-3,
         autocast_dtype: str | None = None) -> Workload:
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                                  n_positions=seq, resid_pdrop=dropout, embd_pdrop=dropout,
                                  attn_pdrop=dropout, bos_token_id=0, eos_token_id=0,
                                  use_cache=False)

    return _workload("hf-gpt2", transformers.GPT2LMHeadModel(cfg), _causal_lm_batch(vocab, seq),
                     _lm_loss, batch_size, lr, autocast_dtype)


def bert(batch_size: int = 8, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4,
         vocab: int = 512, dropout: float = 0.0, lr: float = 1e-3,
         autocast_dtype: str | None = None) -> Workload:
    cfg = transformers.BertConfig(num_hidden_layers=layers, hidden_size=hidden,
                                  num_attention_heads=heads, intermediate_size=4 * hidden,
                                  vocab_size=vocab, max_position_embeddings=seq, num_labels=3,
                                  hidden_dropout_prob=dropout,
                                  attention_probs_dropout_prob=dropout)

    def make_batch(bs, device):
        ids = torch.randint(0, vocab, (bs, seq), device=device)
        lengths = torch.randint(seq // 2, seq + 1, (bs, 1), device=device)
        mask = (torch.arange(seq, device=device)[None, :] < lengths).long()
        return (ids, mask), torch.randint(0, 3, (bs,), device=device)

    return _workload("hf-bert", transformers.BertForSequenceClassification(cfg), make_batch,
                     _class_loss, batch_size, lr, autocast_dtype)


def t5(batch_size: int = 8, seq: int = 8, layers: int = 2, hidden: int = 64, heads: int = 4,
       vocab: int = 512, dropout: float = 0.0, lr: float = 1e-3,
       autocast_dtype: str | None = None) -> Workload:
    cfg = transformers.T5Config(num_layers=layers, num_decoder_layers=layers, d_model=hidden,
                                d_ff=4 * hidden, num_heads=heads, d_kv=hidden // heads,
                                vocab_size=vocab, dropout_rate=dropout, decoder_start_token_id=0,
                                use_cache=False)

    def make_batch(bs, device):
        src = torch.randint(1, vocab, (bs, seq), device=device)
        tgt = torch.randint(1, vocab, (bs, seq + 1), device=device)
        return (src, None, tgt[:, :-1]), tgt[:, 1:]  # (input_ids, attention_mask, decoder ids)

    return _workload("hf-t5", transformers.T5ForConditionalGeneration(cfg), make_batch, _lm_loss,
                     batch_size, lr, autocast_dtype)


def llama(batch_size: int = 8, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4,
          kv_heads: int = 2, vocab: int = 512, lr: float = 1e-3,
          autocast_dtype: str | None = None) -> Workload:
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden,
                                   intermediate_size=4 * hidden, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=seq, use_cache=False)
    return _workload("hf-llama", transformers.LlamaForCausalLM(cfg), _causal_lm_batch(vocab, seq),
                     _lm_loss, batch_size, lr, autocast_dtype)


def mixtral(batch_size: int = 8, seq: int = 16, layers: int = 2, hidden: int = 64,
            heads: int = 4, kv_heads: int = 2, experts: int = 4, vocab: int = 512,
            lr: float = 1e-3, autocast_dtype: str | None = None) -> Workload:
    cfg = transformers.MixtralConfig(vocab_size=vocab, hidden_size=hidden,
                                     intermediate_size=2 * hidden, num_hidden_layers=layers,
                                     num_attention_heads=heads, num_key_value_heads=kv_heads,
                                     num_local_experts=experts, num_experts_per_tok=2,
                                     max_position_embeddings=seq, use_cache=False)
    return _workload("hf-mixtral", transformers.MixtralForCausalLM(cfg),
                     _causal_lm_batch(vocab, seq), _lm_loss, batch_size, lr, autocast_dtype)


def vit(batch_size: int = 8, image: int = 32, patch: int = 8, layers: int = 2, hidden: int = 64,
        heads: int = 4, classes: int = 10, dropout: float = 0.0, lr: float = 1e-3,
        autocast_dtype: str | None = None) -> Workload:
    cfg = transformers.ViTConfig(image_size=image, patch_size=patch, num_hidden_layers=layers,
                                 hidden_size=hidden, num_attention_heads=heads,
                                 intermediate_size=4 * hidden, num_labels=classes,
                                 hidden_dropout_prob=dropout,
                                 attention_probs_dropout_prob=dropout)

    def make_batch(bs, device):
        images = torch.randn(bs, 3, image, image, device=device)
        return (images,), torch.randint(0, classes, (bs,), device=device)

    return _workload("hf-vit", transformers.ViTForImageClassification(cfg), make_batch,
                     _class_loss, batch_size, lr, autocast_dtype)
