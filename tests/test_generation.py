import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf import generation, losses, models


def _model_and_tok():
    tok = models.build_tokenizer(["\n\nHuman: a b c d e f g\n\nAssistant: a b"])
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval(), tok


def test_left_padded_response_logprobs_equal_a_plain_forward_pass():
    model, tok = _model_and_tok()
    prompts = ["\n\nHuman: a\n\nAssistant:", "\n\nHuman: a b c d e f g\n\nAssistant:"]
    torch.manual_seed(1)
    r = generation.generate(model, tok, prompts, max_new_tokens=6, temperature=1.0, top_p=1.0,
                            max_prompt_length=32)
    assert r.query_mask[0, 0] == 0  # the short prompt is left-padded
    with torch.no_grad():
        logp, _, _ = generation.response_logprobs(model, r, temperature=1.0)
        for i in range(len(prompts)):
            q = r.query[i][r.query_mask[i].bool()]
            n = int(r.mask[i].sum())
            ids = torch.cat([q, r.response[i, :n]]).unsqueeze(0)
            plain = losses.logprobs_from_logits(model(ids).logits[:, :-1], ids[:, 1:])[0, -n:]
            torch.testing.assert_close(logp[i, :n], plain, atol=1e-5, rtol=1e-5)


def test_generation_masks_everything_after_eos():
    model, tok = _model_and_tok()
    torch.manual_seed(0)
    r = generation.generate(model, tok, ["\n\nHuman: a\n\nAssistant:"] * 16, max_new_tokens=8, temperature=3.0,
                            top_p=1.0, max_prompt_length=32)
    for resp, m in zip(r.response, r.mask):
        eos = (resp == tok.eos_token_id).nonzero()
        if len(eos):
            first = int(eos[0])
            assert m[: first + 1].all() and not m[first + 1:].any()
            assert (resp[first + 1:] == tok.pad_token_id).all()
        else:
            assert m.all()
