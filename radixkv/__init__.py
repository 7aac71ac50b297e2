"""radixkv: an LLM serving engine built around a prefix cache."""

from radixkv import _kernels_name

_kernels_name.install()
