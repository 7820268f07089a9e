"""eagleray's decoder on the real SmolLM2-135M-Instruct (fp32) against transformers."""

from __future__ import annotations

import torch

PROMPT = [{"role": "user", "content": "Explain in one sentence why the sky is blue."}]


def test_smollm2_logits_aux_and_greedy_match_transformers(smollm2_fp32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagleray.platform.models.attention import AttentionMetadata
    from eagleray.platform.models.llama import LlamaModel

    tok = AutoTokenizer.from_pretrained(str(smollm2_fp32))
    ids = torch.tensor([tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False)])
    ours = LlamaModel.from_dir(smollm2_fp32, dtype="fp32", aux_layer_ids=[2, 15, 27])
    ref = AutoModelForCausalLM.from_pretrained(str(smollm2_fp32), dtype=torch.float32).eval()
    logits, aux = ours.forward_full(ids)  # [1, T, V], [1, T, 3H]
    with torch.no_grad():
        out = ref(ids, output_hidden_states=True)
    torch.testing.assert_close(logits, out.logits, atol=5e-4, rtol=0)
    h = ours.hidden_size
    for j, k in enumerate([2, 15, 27]):
        torch.testing.assert_close(aux[0, :, j * h : (j + 1) * h], out.hidden_states[k][0], atol=1e-3, rtol=1e-5)
    # 8 greedy tokens through the paged cache == transformers' greedy generate
    want = ref.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    cache, table, n = ours.make_kv_cache(num_blocks=16, block_size=16), [list(range(16))], ids.shape[1]
    seq, got = ids[0], []
    with torch.inference_mode():
        for step in range(8):
            ctx = 0 if step == 0 else n + step - 1
            new = seq[ctx:]
            attn = AttentionMetadata.build([len(new)], [ctx], table, 16)
            hidden, _ = ours(new, torch.arange(ctx, ctx + len(new)), attn, cache)
            nxt = ours.compute_logits(hidden[-1:]).argmax(-1)  # [1]
            got.append(int(nxt))
            seq = torch.cat([seq, nxt])
    assert got == want.tolist()
