"""kiln's native CPU kernels: C sources (csrc/, shipped as package data) compiled on first use and cached
(build.py), each bound as a torch.library custom op with shape, dtype and stride checks and a fake
implementation (dequant4.py: NF4 / FP4 dequantization; lora_update.py: QLoRA's fused float32 adapter update).
Every op has a pure-torch counterpart in its caller (kiln.hub.bnb4, kiln.models.common.qlora), the path taken
where there is no compiler. The bottom layer: imports nothing else of kiln."""
