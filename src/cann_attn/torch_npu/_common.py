"""Argument conversions shared by the torch_npu spellings."""

from ..problem.lengths import to_int_list

INT64_MAX = 2**63 - 1


def _ints(value, name: str) -> list[int] | None:
    return to_int_list(value, name)
