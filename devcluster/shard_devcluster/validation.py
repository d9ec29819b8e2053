"""What kube-apiserver checks of a custom resource against its CRD's structural schema before it
stores it (apiextensions-apiserver, v1.36), as field errors in its own words. Pure, but for the CEL
library.

* `validate(schema, obj, old)`: the OpenAPI v3 value validations (kube-openapi's validator: type,
  nullable, enum, minimum/maximum (exclusive), multipleOf, min/maxLength in characters, pattern,
  min/maxItems, required, min/maxProperties, additionalProperties, allOf/anyOf/oneOf/not,
  `x-kubernetes-int-or-string`), then, unless one of those errors leaves the object in a shape the
  rules were not written for, every `x-kubernetes-validations` rule (CEL) of every node that has a
  value: `self` that value, `oldSelf` its old value on an update (a rule naming `oldSelf`, a
  transition rule, runs only where an old value correlates), the error at the rule's `fieldPath`
  with its `reason`, its `message`, its `messageExpression`'s value, or "failed rule: RULE".
  Validation ratcheting (CRDValidationRatcheting, GA): on an update, an error in a value equal to
  its old one is dropped (a CEL rule's becomes a warning), except a transition rule's.
* `FieldError`: apimachinery's field.Error; `cause()` is its entry in a Status's `details.causes`.

CEL is cel-python (`celpy`): the CEL standard library and macros (`has`, `type`, `size`, `all`,
`exists`, `exists_one`, `filter`, `map`, `matches` with RE2 as cel-go). Not there: the Kubernetes CEL
libraries (strings' `lowerAscii`/`split`/..., `quantity`, `url`, `ip`, lists' `sum`/`isSorted`),
optional types (`?.`, `optionalOldSelf`) and the cost budget: a rule using them fails to compile
(`compile_rules` says which), where the real server would accept it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import celpy
from celpy import celtypes
from celpy.evaluation import CELEvalError

MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING"})()
OMIT: Any = type("Omit", (), {"__repr__": lambda self: "OMIT"})()  # field.OmitValueType: no value shown
TYPE_NAMES = {"Required": "Required value", "Invalid": "Invalid value", "NotSupported": "Unsupported value",
              "TooLong": "Too long", "TooMany": "Too many", "TypeInvalid": "Invalid value",
              "Forbidden": "Forbidden", "Duplicate": "Duplicate value"}
BLOCKING = {"NotSupported", "Required", "TooLong", "TooMany", "TypeInvalid"}  # CEL would see a wrong shape
NOT_CHECKED = ("some validation rules were not checked because the object was invalid; correct the existing errors "
               "to complete validation")


def go_value(value: Any) -> str:
    """A value as apimachinery's field errors print it: strings quoted, the rest as JSON."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else json.dumps(value)


@dataclass(frozen=True)
class FieldError:
    type: str
    field: str
    value: Any = OMIT
    detail: str = ""

    def body(self) -> str:
        name = TYPE_NAMES[self.type]
        if self.type in ("Required", "Forbidden", "TooLong") or self.value is OMIT:
            text = name
        else:
            text = f"{name}: {go_value('null' if self.value is None else self.value)}"
        return f"{text}: {self.detail}" if self.detail else text

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}"

    def cause(self) -> dict[str, str]:
        return {"reason": f"FieldValue{self.type}", "message": self.body(), "field": self.field}


def child(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


JSON_TYPES = {"integer": "integer", "number": "number", "string": "string", "boolean": "boolean",
              "object": "object", "array": "array"}


def type_of(value: Any) -> str:
    """The JSON type of a decoded value, as the validator names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", dict: "object", list: "array"}.get(type(value), "unknown")


def _has_type(schema: dict[str, Any], value: Any) -> bool:
    if schema.get("x-kubernetes-int-or-string"):
        return type_of(value) in ("integer", "string")
    wanted, actual = schema.get("type"), type_of(value)
    return wanted is None or wanted == actual or (wanted == "number" and actual == "integer")


def _schema_errors(schema: dict[str, Any], value: Any, path: str, old: Any) -> Iterator[FieldError]:
    """kube-openapi's validation of one value and what it holds; an unchanged value (ratcheting) is
    not checked."""
    if old is not MISSING and old == value:
        return
    wanted = "integer,string" if schema.get("x-kubernetes-int-or-string") else schema.get("type")
    if value is None:
        if wanted and not schema.get("nullable"):
            yield FieldError("TypeInvalid", path, "null", f'{path} in body must be of type {wanted}: "null"')
        return
    if not _has_type(schema, value):
        yield FieldError("TypeInvalid", path, type_of(value),
                         f'{path} in body must be of type {wanted}: "{type_of(value)}"')
        return
    yield from _value_errors(schema, value, path)
    yield from _composition_errors(schema, value, path)
    if isinstance(value, dict):
        for name in schema.get("required") or ():
            if name not in value:
                yield FieldError("Required", child(path, name))
        properties, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        olds = old if isinstance(old, dict) else {}
        for key, item in value.items():
            sub = properties.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                yield from _schema_errors(sub, item, child(path, key), olds.get(key, MISSING))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):  # (items of an atomic list correlate with nothing)
            yield from _schema_errors(schema["items"], item, f"{path}[{i}]", MISSING)


def _value_errors(schema: dict[str, Any], value: Any, path: str) -> Iterator[FieldError]:
    if "enum" in schema and value not in schema["enum"]:
        yield FieldError("NotSupported", path, value, "supported values: " + ", ".join(
            json.dumps(v) if isinstance(v, str) else json.dumps(json.dumps(v)) for v in schema["enum"]))
    if type_of(value) in ("integer", "number"):
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None and (value <= low if schema.get("exclusiveMinimum") else value < low):
            words = "greater than" if schema.get("exclusiveMinimum") else "greater than or equal to"
            yield FieldError("Invalid", path, value, f"{path} in body should be {words} {_number(low)}")
        if high is not None and (value >= high if schema.get("exclusiveMaximum") else value > high):
            words = "less than" if schema.get("exclusiveMaximum") else "less than or equal to"
            yield FieldError("Invalid", path, value, f"{path} in body should be {words} {_number(high)}")
        step = schema.get("multipleOf")
        if step and (value / step) != int(value / step):
            yield FieldError("Invalid", path, value, f"{path} in body should be a multiple of {_number(step)}")
    if isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            yield FieldError("TooLong", path, value, f"may not be more than {schema['maxLength']} bytes")
        if "minLength" in schema and len(value) < schema["minLength"]:
            yield FieldError("Invalid", path, value,
                             f"{path} in body should be at least {schema['minLength']} chars long")
        if "pattern" in schema and not _pattern(schema["pattern"]).search(value):
            yield FieldError("Invalid", path, value, f"{path} in body should match '{schema['pattern']}'")
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            yield FieldError("TooMany", path, len(value), f"must have at most {schema['maxItems']} items")
        if "minItems" in schema and len(value) < schema["minItems"]:
            yield FieldError("Invalid", path, OMIT, f"{path} in body should have at least {schema['minItems']} items")
    if isinstance(value, dict):
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            yield FieldError("TooMany", path, len(value), f"must have at most {schema['maxProperties']} items")
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            yield FieldError("Invalid", path, OMIT,
                             f"{path} in body should have at least {schema['minProperties']} properties")


def _composition_errors(schema: dict[str, Any], value: Any, path: str) -> Iterator[FieldError]:
    for sub in schema.get("allOf") or ():
        yield from _schema_errors(sub, value, path, MISSING)
    if schema.get("anyOf"):
        failures = [list(_schema_errors(sub, value, path, MISSING)) for sub in schema["anyOf"]]
        if all(failures):
            yield FieldError("Invalid", path, OMIT, f"{path} in body must validate at least one schema (anyOf)")
            yield from min(failures, key=len)
    if schema.get("oneOf"):
        passing = sum(not list(_schema_errors(sub, value, path, MISSING)) for sub in schema["oneOf"])
        if passing != 1:
            yield FieldError("Invalid", path, OMIT, f"{path} in body must validate one and only one schema (oneOf)")
    if isinstance(schema.get("not"), dict) and not list(_schema_errors(schema["not"], value, path, MISSING)):
        yield FieldError("Invalid", path, OMIT, f"{path} in body must not validate the schema (not)")


@lru_cache(maxsize=256)
def _pattern(pattern: str) -> re.Pattern:
    return re.compile(pattern)


# ---------------------------------------------------------------- CEL
@dataclass(frozen=True)
class Rule:
    rule: str
    program: Any
    message_program: Any
    transition: bool  # names oldSelf: runs on updates only, never ratcheted
    spec: dict[str, Any]


_ENV = celpy.Environment()


@lru_cache(maxsize=256)
def _compile(expression: str) -> tuple[Any, bool]:
    """(program, whether it names oldSelf); ValueError for an expression that does not compile."""
    try:
        tree = _ENV.compile(expression)
    except celpy.CELParseError as err:
        raise ValueError(f"compilation failed: {str(err).splitlines()[0]}: {expression}") from None
    uses_old = any(True for _ in tree.scan_values(lambda token: token == "oldSelf"))
    return _ENV.program(tree), uses_old


def compile_rules(schema: dict[str, Any], path: str = "") -> list[str]:
    """Compile every rule of a schema (at CRD registration, as the server does); the problems found."""
    problems = []
    for spec in schema.get("x-kubernetes-validations") or ():
        for key in ("rule", "messageExpression"):
            if spec.get(key):
                try:
                    _compile(spec[key])
                except ValueError as err:
                    problems.append(f"{path or '<root>'}: {key} {err}")
    for key, sub in (schema.get("properties") or {}).items():
        problems += compile_rules(sub, child(path, key))
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            problems += compile_rules(schema[key], f"{path}[*]")
    return problems


def _rules(schema: dict[str, Any]) -> list[Rule]:
    rules = []
    for spec in schema.get("x-kubernetes-validations") or ():
        program, transition = _compile(spec["rule"])
        message = _compile(spec["messageExpression"])[0] if spec.get("messageExpression") else None
        rules.append(Rule(spec["rule"], program, message, transition, spec))
    return rules


def to_cel(schema: dict[str, Any], value: Any) -> Any:
    """A decoded value as CEL sees it under its schema (a `number` is a double even if written 1)."""
    if value is None:
        return None
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, dict):
        properties, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        default = extra if isinstance(extra, dict) else {}
        return celtypes.MapType({celtypes.StringType(k): to_cel(properties.get(k, default), v)
                                 for k, v in value.items()})
    if isinstance(value, list):
        return celtypes.ListType([to_cel(schema.get("items") or {}, v) for v in value])
    return celpy.json_to_cel(value)


def _rule_errors(schema: dict[str, Any], value: Any, path: str, old: Any, unchanged: bool,
                 warnings: list[str]) -> Iterator[FieldError]:
    if value is None:
        return  # only values are validated; a rule about presence belongs to the parent
    rules = _rules(schema)
    if rules:
        activation = {"self": to_cel(schema, value)}
        if old is not MISSING and old is not None:
            activation["oldSelf"] = to_cel(schema, old)
        for rule in rules:
            if rule.transition and "oldSelf" not in activation:
                continue
            error = _evaluate(rule, activation, schema, value, path)
            if error is not None and unchanged and not rule.transition:
                warnings.append(str(error))  # ratcheted
            elif error is not None:
                yield error
    properties, extra = schema.get("properties") or {}, schema.get("additionalProperties")
    if isinstance(value, dict):
        olds = old if isinstance(old, dict) else {}
        for key, item in value.items():
            sub, name = (properties[key], child(path, key)) if key in properties else \
                (extra, f"{path}[{key}]") if isinstance(extra, dict) else (None, "")
            if sub is not None:
                previous = olds.get(key, MISSING)
                yield from _rule_errors(sub, item, name, previous,
                                        previous is not MISSING and previous == item, warnings)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):  # uncorrelated: they ratchet with their list
            yield from _rule_errors(schema["items"], item, f"{path}[{i}]", MISSING, unchanged, warnings)


def _evaluate(rule: Rule, activation: dict[str, Any], schema: dict[str, Any], value: Any,
              path: str) -> FieldError | None:
    shown = OMIT if schema.get("type") in ("object", "array") else value
    what = rule.spec.get("message", "").strip() or rule.rule.strip()
    try:
        result = rule.program.evaluate(activation)
    except CELEvalError as err:
        reason = err.args[0] if err.args else str(err)
        return FieldError("Invalid", path, schema.get("type", ""), f"{reason} evaluating rule: {what}")
    if result is True or result == celtypes.BoolType(True):
        return None
    if rule.spec.get("fieldPath"):
        path = path + rule.spec["fieldPath"] if rule.spec["fieldPath"].startswith((".", "[")) else \
            child(path, rule.spec["fieldPath"])
    detail = ""
    if rule.message_program is not None:
        try:
            text = str(rule.message_program.evaluate(activation)).strip()
            detail = text if text and "\n" not in text else ""
        except CELEvalError:
            detail = ""
    detail = detail or rule.spec.get("message", "").strip() or f"failed rule: {rule.rule.strip()}"
    reason = rule.spec.get("reason", "FieldValueInvalid")
    if reason in ("FieldValueForbidden", "FieldValueRequired"):
        return FieldError(reason.removeprefix("FieldValue"), path, OMIT, detail)
    if reason == "FieldValueDuplicate":
        return FieldError("Duplicate", path, shown)
    return FieldError("Invalid", path, shown, detail)


# ---------------------------------------------------------------- together
def validate(schema: dict[str, Any], obj: Any, old: Any = MISSING, path: str = "",
             warnings: list[str] | None = None) -> list[FieldError]:
    """The errors kube-apiserver finds in a custom resource (or its part at `path`) already pruned
    and defaulted, on a create (`old` MISSING) or an update; ratcheted CEL errors go to `warnings`."""
    errors = list(_schema_errors(schema, obj, path, old))
    if any(e.type in BLOCKING for e in errors):
        return errors + [FieldError("Invalid", "<nil>", None, NOT_CHECKED)]
    unchanged = old is not MISSING and old == obj
    return errors + list(_rule_errors(schema, obj, path, old, unchanged, warnings if warnings is not None else []))
