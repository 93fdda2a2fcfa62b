"""Environments (``Env``) and the asyncio pool that runs many episodes at once."""

from .base import Env
from .calculator import Calculator
from .reverse import ReverseDigits

ENVS = {"reverse": ReverseDigits, "calculator": Calculator}
"""Built-in environment names for --env (which also takes module:Class: plugins.py)."""

__all__ = ["ENVS", "Calculator", "Env", "ReverseDigits"]
