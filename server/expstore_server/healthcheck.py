"""``expstore-healthcheck``: exit 0 when the server's gRPC health service answers SERVING.

The image (deploy/Dockerfile) runs it as its HEALTHCHECK, and the TLS
variant of the Kubernetes manifests (deploy/k8s/tls) runs it as an exec probe: the
kubelet's native ``grpc:`` probes speak plaintext only, and a server with a certificate
speaks TLS only. A draining server answers NOT_SERVING, so this fails while it drains.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expstore-healthcheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="127.0.0.1:50051", help="server address (default 127.0.0.1:50051)")
    p.add_argument("--service", default="",
                   help="health service name: '' (default) for the server, 'expstore.remote' for its remote tier")
    p.add_argument("--tls-ca", metavar="PEM", help="connect with TLS, trusting this root certificate")
    p.add_argument("--server-name", help="with --tls-ca: the name to check the certificate against "
                                         "(default: the host of --address)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    return p


def channel(args: argparse.Namespace) -> grpc.Channel:
    if not args.tls_ca:
        return grpc.insecure_channel(args.address)
    credentials = grpc.ssl_channel_credentials(root_certificates=Path(args.tls_ca).read_bytes())
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(args.address, credentials, options)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    request = health_pb2.HealthCheckRequest(service=args.service)
    with channel(args) as ch:
        try:
            status = health_pb2_grpc.HealthStub(ch).Check(request, timeout=args.timeout).status
        except grpc.RpcError as e:
            print(f"expstore-healthcheck: {args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
