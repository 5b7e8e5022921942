"""The shape of JSON itself, for the one place typed data meets the disk or the wire.

`JsonObject` is what `json.loads` gives for an object and what a `to_json()` returns. It is meant
only for that boundary: a record's `to_json`/`from_json`, a file just read before it is parsed into
its class, and free-form parts the contract leaves open (a profile's extra keys, a server's reply
before it is checked). Everything between the boundaries is a named class.
"""
from __future__ import annotations

from typing import Union

JsonValue = Union[None, bool, int, float, str, "list[JsonValue]", "dict[str, JsonValue]"]
JsonObject = dict[str, JsonValue]
