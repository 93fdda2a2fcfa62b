"""Environments (``Env``) and the asyncio pool that runs many episodes at once."""

from .base import Env
from .calculator import Calculator
from .reverse import ReverseDigits

ENVS = {"reverse": ReverseDigits, "calculator": Calculator}
"""Environment names for the producer CLI (--env)."""

__all__ = ["ENVS", "Calculator", "Env", "ReverseDigits"]
