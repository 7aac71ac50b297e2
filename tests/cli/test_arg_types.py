"""``radixkv.arg_types``: each value type's value, and its one-line error that argparse prefixes
with the flag's name before exiting 2."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pytest

from radixkv.arg_types import (
    bounded_int,
    comma_choices,
    fraction,
    non_negative_int,
    non_negative_seconds,
    positive_float,
    positive_int,
    positive_int_list,
)


@pytest.mark.parametrize("arg_type,text,value", [
    (positive_int, "1", 1),
    (positive_int, " 42 ", 42),
    (non_negative_int, "0", 0),
    (bounded_int(1, 1024), "1024", 1024),
    (positive_int_list, "2048,8191,", [2048, 8191]),
    (comma_choices(("int8", "fp8_e4m3")), "fp8_e4m3, int8,fp8_e4m3", ("fp8_e4m3", "int8")),
    (comma_choices(("int8",), none_word="none"), "NONE", ()),
    (fraction, "0", 0.0),
    (fraction, "1", 1.0),
    (positive_float, "2.5e-3", 2.5e-3),
    (non_negative_seconds, "0", 0.0),
], ids=lambda v: getattr(v, "__name__", repr(v)))
def test_value(arg_type: Callable[[str], Any], text: str, value: Any) -> None:
    assert arg_type(text) == value


@pytest.mark.parametrize("arg_type,text,message", [
    (positive_int, "0", "must be an int >= 1, got 0"),
    (positive_int, "1.5", "expected an int >= 1, got '1.5'"),
    (non_negative_int, "-1", "must be an int >= 0, got -1"),
    (bounded_int(0, 65535), "65536", "must be an int in [0, 65535], got 65536"),
    (bounded_int(0, 65535), "http", "expected an int in [0, 65535], got 'http'"),
    (positive_int_list, "1,x", "expected comma-separated integers, got '1,x'"),
    (positive_int_list, "4,0", "expected integers >= 1, got '4,0'"),
    (positive_int_list, ",", "expected integers >= 1, got ','"),
    (comma_choices(("int8", "fp8_e4m3"), none_word="none"), "int4",
     "expected a comma list of int8, fp8_e4m3 (or none), got 'int4'"),
    (comma_choices(("a", "b")), "", "expected a comma list of a, b, got ''"),
    (fraction, "1.01", "expected a number in [0, 1], got '1.01'"),
    (fraction, "nan", "expected a number in [0, 1], got 'nan'"),
    (positive_float, "0", "expected a finite number > 0, got '0'"),
    (positive_float, "inf", "expected a finite number > 0, got 'inf'"),
    (non_negative_seconds, "-0.5", "expected a number of seconds >= 0, got '-0.5'"),
    (non_negative_seconds, "soon", "expected a number of seconds >= 0, got 'soon'"),
], ids=lambda v: getattr(v, "__name__", repr(v)))
def test_error(arg_type: Callable[[str], Any], text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        arg_type(text)
    assert str(exc.value) == message


def test_parser_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--port", type=bounded_int(0, 65535))
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--port", "70000"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "p: error: argument --port: must be an int in [0, 65535], got 70000")


def test_bounded_int_rejects_an_empty_range() -> None:
    with pytest.raises(ValueError, match=r"^maximum: must be >= minimum 5, got 4$"):
        bounded_int(5, 4)
