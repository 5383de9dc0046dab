"""Importing this module applies torch_npu's ``transfer_to_npu`` rewrites (cuda -> npu -> the install target):
:mod:`cann_attn.torch_npu._transfer`. Imported as ``torch_npu.contrib.transfer_to_npu`` after install(); the
absolute import keeps one copy of the package's state under either name."""

from cann_attn.torch_npu._transfer import enable

enable()
