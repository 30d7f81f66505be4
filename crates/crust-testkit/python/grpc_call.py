#!/usr/bin/env python3
"""Calls a crust gRPC server with grpcio (grpc-core), as a Python, C++ or
Ruby client would: a plain insecure channel on the unix socket, with the
default :authority (grpc-core sends the %-encoded socket path).

usage: grpc_call.py PROTO_DIR TARGET < calls.json

calls.json is a list of {"method": "csi.v1.Identity/Probe", "request": {...}}
(requests in protobuf JSON). Prints one JSON line per call:
{"code": "OK", "details": "...", "response": {...}}. The message classes
come from PROTO_DIR, compiled at run time by grpcio-tools (no network).
"""
import importlib
import importlib.resources
import json
import os
import sys
import tempfile

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_tools import protoc


def load_protos(proto_dir, out):
    include = str(importlib.resources.files("grpc_tools") / "_proto")
    files = sorted(f for f in os.listdir(proto_dir) if f.endswith(".proto"))
    rc = protoc.main(["protoc", f"-I{proto_dir}", f"-I{include}", f"--python_out={out}", *files])
    if rc != 0:
        sys.exit(f"grpc_tools.protoc failed with {rc}")
    sys.path.insert(0, out)
    for f in files:
        importlib.import_module(f[: -len(".proto")] + "_pb2")


def call(channel, method, request):
    service, name = method.rsplit("/", 1)
    desc = descriptor_pool.Default().FindServiceByName(service).FindMethodByName(name)
    req_cls = message_factory.GetMessageClass(desc.input_type)
    resp_cls = message_factory.GetMessageClass(desc.output_type)
    stub = channel.unary_unary(
        f"/{service}/{name}",
        request_serializer=req_cls.SerializeToString,
        response_deserializer=resp_cls.FromString,
    )
    try:
        resp = stub(json_format.ParseDict(request, req_cls()), timeout=30)
        return {
            "code": "OK",
            "details": "",
            "response": json_format.MessageToDict(resp, preserving_proto_field_name=True),
        }
    except grpc.RpcError as e:
        return {"code": e.code().name, "details": e.details() or "", "response": None}


def main():
    proto_dir, target = sys.argv[1], sys.argv[2]
    calls = json.load(sys.stdin)
    with tempfile.TemporaryDirectory() as out:
        load_protos(proto_dir, out)
        with grpc.insecure_channel(target) as channel:
            for c in calls:
                print(json.dumps(call(channel, c["method"], c.get("request", {}))), flush=True)


if __name__ == "__main__":
    main()
