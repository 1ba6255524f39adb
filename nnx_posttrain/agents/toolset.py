"""The tools of a run: functions (``--algo.tools module:function,...``) and environments
(``--algo.environment module:Class``, or ``name=module:Class,...`` chosen by each record's
``environment`` column), with TRL 1.16's semantics (``GRPOTrainer(tools=...,
environment_factory=...)``):

- one environment instance per rollout (instances are kept and ``reset`` between rollouts);
  ``reset(**record)`` gets the record's columns and may return text appended to the last user
  message; its public methods (not ``reset``, not ``get_reward``) are tools beside the functions;
- an environment's ``get_reward()`` (optional) scores each finished rollout from its state: a
  reward function named after the class, beside ``--algo.rewards``;
- a call runs with a time limit (``--algo.tool-timeout``); a result is written as ``str(result)``,
  a failure (an exception, an unknown tool, a malformed call, the time limit) as
  ``str({"error": message})``, TRL's text, and counted in ``tools/failure_frequency``.
"""

from __future__ import annotations

import inspect
import threading

from nnx_posttrain import errors, user_code
from nnx_posttrain.agents.schema import SchemaError, function_schema


def _specs(text: str | None) -> list[str]:
    return [s.strip() for s in (text or "").split(",") if s.strip()]


def environment_methods(instance) -> list:
    """An environment's tools: its public methods other than ``reset`` and ``get_reward``."""
    return [member for name, member in inspect.getmembers(instance, inspect.ismethod)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


class Toolset:
    """The functions and environment classes of a run (see the module docstring)."""

    def __init__(self, tools: str | None = None, environment: str | None = None,
                 timeout: float = 10.0):
        self.functions = [user_code.load(s, "--algo.tools") for s in _specs(tools)]
        self.timeout = timeout
        self.environments: dict[str | None, type] = {}
        for spec in _specs(environment):
            name, _, target = spec.rpartition("=")
            self.environments[name or None] = user_code.load(target, "--algo.environment")
        if None in self.environments and len(self.environments) > 1:
            raise errors.ConfigError("--algo.environment: give one 'module:Class', or name each "
                                     "class ('name=module:Class,...', chosen by the records' "
                                     "'environment' column)")
        self._pool: dict[str | None, list] = {name: [] for name in self.environments}
        self._schemas = {}
        for fn in self.functions:
            self._schemas[fn] = self._schema(fn, "--algo.tools")
        for name, cls in self.environments.items():
            if not callable(getattr(cls, "reset", None)):
                raise errors.ConfigError(f"--algo.environment {cls.__name__}: an environment "
                                         "needs a reset(**record) method")

    @property
    def enabled(self) -> bool:
        return bool(self.functions or self.environments)

    @staticmethod
    def _schema(fn, what):
        try:
            return function_schema(fn)
        except SchemaError as exc:
            raise errors.ConfigError(f"{what}: {exc}") from None

    def rewarding(self) -> list[tuple[str, type]]:
        """(class name, class) of the environments that score rollouts (``get_reward``)."""
        return [(cls.__name__, cls) for cls in self.environments.values()
                if callable(getattr(cls, "get_reward", None))]

    def check_record(self, record: dict) -> None:
        """``DataError`` naming the record for a multi-environment record whose ``environment``
        column is missing or names no class."""
        if not self.environments or None in self.environments:
            return
        name = record.get("environment")
        if name not in self.environments:
            where = record.get("_where", "a record")
            raise errors.DataError(f"{where}: field 'environment' is {name!r}; the run's "
                                   f"environments are {sorted(self.environments)}")

    def open(self, records: list[dict]) -> list["Episode"]:
        """One episode per rollout row: its environment instance (from the pool, ``reset`` with
        the record's columns), its tools and their schemas, and the text ``reset`` returned."""
        taken: dict[str | None, int] = {}
        out = []
        for record in records:
            instance, observation = None, None
            if self.environments:
                self.check_record(record)
                name = record.get("environment") if None not in self.environments else None
                cls, pool, k = self.environments[name], self._pool[name], taken.get(name, 0)
                if k == len(pool):
                    pool.append(_called(cls, "creating it", record, cls))
                taken[name], instance = k + 1, pool[k]
                columns = {key: value for key, value in record.items()
                           if not key.startswith("_") and not (key == "environment"
                                                               and None not in self.environments)}
                observation = _observation(cls, record, _called(cls, "reset", record,
                                                                instance.reset, **columns))
            methods = environment_methods(instance) if instance is not None else []
            functions = list(self.functions) + methods
            schemas = [self._schemas[fn] for fn in self.functions] + [
                self._method_schema(type(instance), m) for m in methods]
            out.append(Episode(instance, {fn.__name__: fn for fn in functions}, schemas,
                               observation, self.timeout))
        return out

    def _method_schema(self, cls, method) -> dict:
        key = (cls, method.__name__)
        if key not in self._schemas:
            self._schemas[key] = self._schema(method, f"--algo.environment {cls.__name__}")
        return self._schemas[key]


class EnvironmentFailed(errors.UserError):
    """An environment class raised while it was created or reset; the message names the class,
    the record, and the file and line that raised."""


def _called(cls, what: str, record: dict, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, user code of environment ``cls``: an exception it raises (or a
    ``sys.exit``) ends the run as ``EnvironmentFailed`` naming what failed where, in the user's
    file (``user_code.failure``)."""
    try:
        return fn(*args, **kwargs)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a user's environment
        raise EnvironmentFailed(
            f"--algo.environment {cls.__name__}: {what} failed for "
            f"{record.get('_where', 'a record')}{user_code.failure(exc, fn)}") from None


def _observation(cls, record: dict, value):
    """What ``reset`` returned, checked: text appended to the last user message, or None;
    anything else is ``EnvironmentFailed`` naming ``reset``'s file and line."""
    if value is None or isinstance(value, str):
        return value
    raise EnvironmentFailed(
        f"--algo.environment {cls.__name__}: reset returned a {type(value).__name__} for "
        f"{record.get('_where', 'a record')} (reset at {user_code.defined_at(cls.reset)}); it "
        "returns text, appended to the last user message, or None")


class Episode:
    """One rollout's tools: ``call(name, arguments) -> (text, failed)``."""

    def __init__(self, environment, tools: dict, schemas: list[dict], observation, timeout):
        self.environment, self.tools, self.schemas = environment, tools, schemas
        self.observation, self.timeout = observation, timeout

    def call(self, name: str, arguments: dict) -> tuple[str, bool]:
        """The result's text (``str(result)``) and False, or the failure's text
        (``str({"error": ...})``) and True: an unknown tool, an exception, a ``sys.exit``, a
        result whose ``str()`` raises, the time limit."""
        fn = self.tools.get(name)
        if fn is None:
            return str({"error": f"Tool {name} not found."}), True
        box: dict = {}

        def run():  # the result is made text here too: its __str__ is the user's code
            try:
                box["result"] = str(fn(**arguments))
            except SystemExit as exc:  # not the process's exit: a failed call
                box["error"] = f"Tool {name} called sys.exit({user_code.text(exc.code)})."
            except Exception as exc:  # noqa: BLE001 - a tool's failure is text for the model
                box["error"] = user_code.text(exc)

        worker = threading.Thread(target=run, daemon=True, name=f"tool {name}")
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():  # left running (a thread cannot be stopped); its result is dropped
            return str({"error": f"Tool {name} timed out after {self.timeout:g} s."}), True
        if "error" in box:
            return str({"error": box["error"]}), True
        return box["result"], False
