"""Runs in the LMCache 0.5.6 venv: encodes and decodes `lm://` headers and `RemoteMetadata` with
LMCache's own classes (`lmcache.v1.protocol`), for the byte-compat tests.

    python lm_protocol_codec.py < request.json > result.json

request: {"client": [msg...], "server": [msg...], "remote": [meta...],
          "decode_client": [hex...], "decode_server": [hex...], "decode_remote": [hex...]}
A client msg is {"command", "key", "length", "fmt", "dtype", "shape", "location"}; a server msg
{"code", "length", "fmt", "dtype", "shape", "location"}; a remote meta {"length", "fmt", "dtypes",
"shapes"}. Names are LMCache's enum names, torch dtype names (or null), LMCache location names
(or null). Encoded messages come back as hex; decoded ones as the same kind of dict.
"""

from __future__ import annotations

import json
import logging
import sys

import torch
from lmcache.v1 import protocol as p
from lmcache.v1.memory_management import MemoryFormat


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def encode_client(m: dict) -> str:
    msg = p.ClientMetaMessage(p.ClientCommand[m["command"]], p.parse_cache_key(m["key"]), m["length"],
                              MemoryFormat[m["fmt"]], _dtype(m["dtype"]), torch.Size(m["shape"]),
                              m["location"])
    return msg.serialize().hex()


def encode_server(m: dict) -> str:
    msg = p.ServerMetaMessage(p.ServerReturnCode[m["code"]], m["length"], MemoryFormat[m["fmt"]],
                              _dtype(m["dtype"]), torch.Size(m["shape"]), m["location"])
    return msg.serialize().hex()


def encode_remote(m: dict) -> str:
    p.init_remote_metadata_info(len(m["dtypes"]))
    meta = p.RemoteMetadata(m["length"], [torch.Size(s) for s in m["shapes"]],
                            [_dtype(d) for d in m["dtypes"]], MemoryFormat[m["fmt"]])
    return meta.serialize().hex()


def decode_client(h: str) -> dict:
    m = p.ClientMetaMessage.deserialize(bytes.fromhex(h))
    return {"command": m.command.name, "key": m.key.to_string(), "length": m.length, "fmt": m.fmt.name,
            "dtype": _dtype_name(m.dtype), "shape": list(m.shape), "location": m.location}


def decode_server(h: str) -> dict:
    m = p.ServerMetaMessage.deserialize(bytes.fromhex(h))
    return {"code": m.code.name, "length": m.length, "fmt": m.fmt.name, "dtype": _dtype_name(m.dtype),
            "shape": list(m.shape), "location": m.location}


def decode_remote(h: str) -> dict:
    raw = bytes.fromhex(h)
    p.init_remote_metadata_info((len(raw) - 8) // 20)
    m = p.RemoteMetadata.deserialize(raw)
    return {"length": m.length, "fmt": m.fmt.name, "dtypes": [_dtype_name(d) for d in m.dtypes],
            "shapes": [list(s) for s in m.shapes]}


def main() -> None:
    logging.disable(logging.WARNING)
    req = json.load(sys.stdin)
    out = {
        "client": [encode_client(m) for m in req.get("client", [])],
        "server": [encode_server(m) for m in req.get("server", [])],
        "remote": [encode_remote(m) for m in req.get("remote", [])],
        "decode_client": [decode_client(h) for h in req.get("decode_client", [])],
        "decode_server": [decode_server(h) for h in req.get("decode_server", [])],
        "decode_remote": [decode_remote(h) for h in req.get("decode_remote", [])],
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
