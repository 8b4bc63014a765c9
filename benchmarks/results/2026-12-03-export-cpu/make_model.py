import torch, time
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                  num_key_value_heads=4, vocab_size=32000)
with torch.device("meta"):
    m = LlamaForCausalLM(cfg)
m = m.to_empty(device="cpu").to(torch.bfloat16)
for p in m.parameters():
    p.data.normal_(0, 0.02)
m.save_pretrained("/tmp/ex/model")
