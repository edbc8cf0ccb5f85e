#!/usr/bin/env bash
# Stage vLLM 0.34.0 with its torch 2.14.0, triton 3.8.0 and NCCL 2.30.7 for a GPU machine whose image has torch 2.11
# (ci/native_matrix.sh unpacks them there): three xz archives split into .device-stage034/{a,b,c}K of at most
# 48 MiB (git-ignored), one device call each.
#   a: torch 2.14.0, torchvision 0.29.0, triton 3.8.0 (cp312 wheels, unpacked; executables kept executable)
#   b: vLLM 0.34.0 without the FA2 kernels, the MoE kernels and the router binary (a dense model on Hopper runs FA3
#      or FlashMLA; both imports are optional in vLLM), and the Python packages vLLM 0.34 imports at versions the
#      image (which serves vLLM 0.26.0) may not have: transformers 5.x and its hub and tokenizers, mistral_common,
#      xgrammar, oss-harmony, depyf, pillow 13 and the small packages they pin.
#   c: libnccl.so.2 2.30.7: torch 2.14.0 links 16 NCCL functions (ncclCommGrow, ncclCommSuspend, ...) that NCCL 2.27
#      does not export, and a library resolved at load fails the import of torch.
# Usage, from the project's root:  ci/stage_vllm034.sh   (downloads about 1.1 GB; a few minutes on 2 cores)
set -euo pipefail
DEST=${DEST:-.device-stage034}  # a folder of the tree (ignored by git) or an absolute path
WORK=${WORK:-$(mktemp -d)}
case "$DEST" in /*) ;; *) grep -qxF "/$DEST/" .git/info/exclude 2>/dev/null || echo "/$DEST/" >> .git/info/exclude ;; esac
PLAT=""
for p in 2_39 2_35 2_34 2_31 2_28 2_27 2_26 2_25 2_24 2_18 2_17 2_12; do PLAT="$PLAT --platform manylinux_${p}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64"
get() {  # pip's own status decides (its location warnings filtered out)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d "$@" \
    2> >(grep -v '^WARNING: Location' >&2)
}
get "$WORK/a" torch==2.14.0 torchvision==0.29.0 triton==3.8.0
get "$WORK/b" vllm==0.34.0 transformers==5.22.0 tokenizers==0.23.3 huggingface_hub==2.5.0 hf-xet==1.8.0 \
  httpx2==2.17.0 httpcore2==2.17.0 safetensors==0.8.0 regex==2026.12.2 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 \
  oss-harmony==0.0.11 mistral_common==1.13.1 pycountry==26.2.16 depyf==0.20.0 astor==0.8.1 dill==0.4.1 \
  typer==0.29.3 click==8.5.1 rich==15.0.0 shellingham==1.5.4 pygments==2.21.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
  annotated-doc==0.0.7 pillow==13.0.0 requests==2.34.2 certifi==2026.10.19.post1 urllib3==2.8.0 idna==3.21 \
  charset-normalizer==3.5.3 filelock==4.3.2 packaging==26.4 typing_extensions==4.16.0 compressed-tensors==0.17.0 \
  lark==1.2.2 outlines_core==0.2.14 llguidance==1.7.6
get "$WORK/c" nvidia-nccl-cu13==2.30.7
rm -rf "$WORK/sa" "$WORK/sb" "$WORK/sc" && mkdir -p "$WORK/sa" "$WORK/sb" "$WORK/sc"
for w in "$WORK"/a/*.whl; do (cd "$WORK/sa" && unzip -q -o "$w"); done
for w in "$WORK"/b/vllm-*.whl "$WORK"/b/*.whl; do (cd "$WORK/sb" && unzip -q -o "$w"); done
( cd "$WORK/sb" && rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
  && rm -rf vllm/third_party/deep_gemm/include vllm/third_party/fmha_sm100/cutlass )
(cd "$WORK/sc" && unzip -q -o "$WORK"/c/*.whl && rm -rf nvidia/nccl/include)
chmod +x "$WORK"/sa/triton/backends/nvidia/bin/* "$WORK"/sa/torch/bin/* 2>/dev/null || true
rm -rf "$DEST" && mkdir -p "$DEST"
for g in a b c; do
  tar -cf - -C "$WORK/s$g" . | xz -T0 -4 | split -b 48M -d -a 2 - "$DEST/$g"
done
ls -la "$DEST"
echo "staged: $(ls "$DEST" | wc -l) parts in $DEST/; ci/native_matrix.sh says how they reach the GPU machine"
