"""The decoder's building blocks: braid's own kernels on the CPU, torch's elsewhere.

On a CPU with AVX-512 or AVX2 + FMA, the linear layers, RMSNorm, SwiGLU and GeGLU, RoPE and the decode
steps' attention run in braid's C kernels (csrc/): each weight matrix is packed once into 32-column panels
in its own format (fp32, bf16, f16, or GGUF's Q8_0/Q4_0/Q4_1/Q6_K/Q4_K blocks), streamed from memory once
per call whatever the number of rows, and widened to fp32 in registers; or, with --activations int8, a
quantized matrix multiplies each row of x quantized to int8 per block of 32 with the CPU's integer dot
products (csrc/int8.c), and with --activations bf16 a bf16 matrix multiplies each row rounded to bf16
with AVX-512 BF16's vdpbf16ps (csrc/bf16.c). Each small op is one call
instead of several torch ops (csrc/kernels.h says why). Elsewhere (CUDA, an older CPU, a build
without a C compiler, or --kernels torch) the same functions run torch's ops on weights dequantized
to the compute dtype.

One module per job:

- extension.py: the C extension (csrc/), loaded once and checked against this code's layout, and the
  layout's constants (panels, blocks, formats, the one-call step's table fields);
- selfcheck.py: a build's check against torch at start, on the CPU it runs on;
- pick.py: which build runs (the best this CPU has, or BRAID_KERNELS_ISA's), and which ops;
- packing.py: weight matrices packed into panels in their own format, and the linear layers over them;
- ops.py: the small ops, torch's (TorchOps) and braid's (CpuKernelOps);
- step.py: the C attention over the paged KV cache, and a whole pass in one call (DecodeStep).
"""
