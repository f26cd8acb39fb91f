"""The argument checks of ``specforest.validation`` and the defaults of ``specforest.devices``."""

import math

import numpy as np
import pytest
import torch

from specforest import devices
from specforest.validation import (
    check_choice,
    check_churn,
    check_int,
    check_ints,
    check_number,
    check_optional_int,
    is_int,
)


def test_is_int_refuses_bool_and_floats():
    assert is_int(3) and is_int(np.int64(3)) and is_int(-1)
    assert not any(is_int(v) for v in (True, False, 3.0, "3", None, torch.tensor(3)))


@pytest.mark.parametrize(
    "value,error,match",
    [
        (True, TypeError, r"steps must be an int >= 1, got bool"),
        (2.5, TypeError, r"steps must be an int >= 1, got float"),
        (math.nan, TypeError, r"steps must be an int >= 1, got float"),
        ("3", TypeError, r"steps must be an int >= 1, got str"),
        (0, ValueError, r"steps must be an int >= 1, got 0"),
    ],
)
def test_check_int_refuses(value, error, match):
    with pytest.raises(error, match=match):
        check_int("steps", value, 1)


def test_check_int_states_a_closed_range():
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 9\], got 10"):
        check_int("seed", 10, 0, 9)
    with pytest.raises(TypeError, match=r"seed must be an int in \[0, 9\], got bool"):
        check_int("seed", False, 0, 9)
    value = check_int("seed", np.int64(9), 0, 9)
    assert value == 9 and type(value) is int


def test_check_optional_int():
    assert check_optional_int("max_rows", None, 1) is None
    assert check_optional_int("max_rows", 4, 1) == 4
    with pytest.raises(TypeError, match=r"max_rows must be None or an int >= 1, got bool"):
        check_optional_int("max_rows", True, 1)
    with pytest.raises(TypeError, match=r"max_rows must be None or an int >= 1, got float"):
        check_optional_int("max_rows", math.nan, 1)
    with pytest.raises(ValueError, match=r"max_rows must be None or an int >= 1, got 0"):
        check_optional_int("max_rows", 0, 1)


def test_check_ints():
    assert check_ints("ks", (2, np.int64(3))) == [2, 3]
    assert check_ints("ks", torch.tensor([1, 2])) == [1, 2]
    assert check_ints("ks", []) == []
    with pytest.raises(TypeError, match=r"ks\[1\] must be an int, got True"):
        check_ints("ks", [2, True])
    with pytest.raises(TypeError, match=r"ks\[0\] must be an int >= 1, got float"):
        check_ints("ks", [math.nan], 1)
    with pytest.raises(ValueError, match=r"ks\[1\] must be an int in \[1, 4\], got 5"):
        check_ints("ks", [2, 5], 1, 4)
    with pytest.raises(ValueError, match=r"ks must hold at least one int >= 1"):
        check_ints("ks", [], 1, nonempty=True)
    for bad in ("12", 3, torch.tensor([1.0]), torch.tensor([[1]]), torch.tensor([True])):
        with pytest.raises(TypeError, match=r"ks must be a sequence of ints"):
            check_ints("ks", bad)


@pytest.mark.parametrize(
    "value,error,match",
    [
        (True, TypeError, r"shift must be a finite number > 0, got bool"),
        ("1", TypeError, r"shift must be a finite number > 0, got str"),
        (math.nan, ValueError, r"shift must be a finite number > 0, got nan"),
        (math.inf, ValueError, r"shift must be a finite number > 0, got inf"),
        (0, ValueError, r"shift must be a finite number > 0, got 0"),
        (-1.5, ValueError, r"shift must be a finite number > 0, got -1.5"),
    ],
)
def test_check_number_refuses(value, error, match):
    with pytest.raises(error, match=match):
        check_number("shift", value, 0, lo_open=True)


def test_check_number_ranges():
    assert check_number("p", np.float32(0.5), 0, 1) == 0.5
    assert check_number("p", 1, 0, 1) == 1.0 and type(check_number("p", 1, 0, 1)) is float
    with pytest.raises(ValueError, match=r"p must be a finite number in \[0, 1\], got 1.5"):
        check_number("p", 1.5, 0, 1)
    with pytest.raises(ValueError, match=r"p must be a finite number in \(0, 1\], got 0"):
        check_number("p", 0, 0, 1, lo_open=True)
    with pytest.raises(ValueError, match=r"p must be a finite number >= 0, got -0.1"):
        check_number("p", -0.1, 0)


@pytest.mark.parametrize(
    "value,error",
    [(True, TypeError), ("0.5", TypeError), (0, ValueError), (1.01, ValueError), (math.nan, ValueError)],
)
def test_check_churn_refuses(value, error):
    with pytest.raises(error, match=r"churn must be (a float )?in \(0, 1\]"):
        check_churn(value)


def test_check_churn_accepts():
    assert check_churn(1) == 1.0 and type(check_churn(1)) is float
    assert check_churn(np.float64(0.3)) == 0.3


def test_check_choice():
    assert check_choice("grid", "uniform", ("flow_match", "uniform")) == "uniform"
    with pytest.raises(ValueError, match=r"grid must be one of flow_match, uniform; got 'linear'"):
        check_choice("grid", "linear", ("flow_match", "uniform"))


def test_default_device_follows_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices.default_device() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.default_device() == "cpu"


@pytest.mark.parametrize(
    "device,dtype",
    [
        ("cuda", "float16"),
        ("cuda:1", "float16"),
        (torch.device("cuda", 0), "float16"),
        ("cpu", "float32"),
        ("mps", "float32"),
    ],
)
def test_default_dtype(device, dtype):
    assert devices.default_dtype(device) == dtype


def test_set_threads(monkeypatch):
    threads = torch.get_num_threads()
    try:
        assert devices.set_threads(1) == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert devices.set_threads(None) == 2 and torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000000")
        assert devices.set_threads(None) == 1
    finally:
        torch.set_num_threads(threads)


def test_the_cli_reexports_set_threads():
    from specforest.cli.common import set_threads

    assert set_threads is devices.set_threads
