"""The control plane's security, with real servers: the cluster token on every
internal call, the broker's hold on instance ids and on who may speak for a
request, and the whole stack over mutual TLS with certificates made here."""

from __future__ import annotations

import asyncio
import base64
import datetime
import ipaddress
import json
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import AsyncOpenAI

from services.broker.server import BrokerConfig, BrokerServer
from services.encoder.server import EncoderServer
from services.gateway.server import GatewayConfig, GatewayServer
from services.language.engine.config import EngineConfig
from services.language.server import LanguageServer
from services.loadgen.synthetic import encode_image, random_image
from services.proto import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    encoder_pb2,
    encoder_pb2_grpc,
    language_pb2,
    language_pb2_grpc,
)
from services.runtime import env
from services.runtime.grpc_server import channel
from services.runtime.security import Security
from services.triton.launcher import TritonServer
from services.wire.messages import Abort, EmbeddingMeta, MediaGrid, Plane, Prealloc
from services.wire.transport import Transport
from tests.broker.peers import attach, encoder, language, wait_for
from tests.reflection import grpcurl, list_services
from tests.stack import MODEL, start_broker, start_encoder, start_language

pytestmark = pytest.mark.asyncio(loop_scope="session")

TOKEN = "s3cret-cluster-token"
SERVER_AUTH, CLIENT_AUTH = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH


@dataclass(frozen=True)
class Certificates:
    """A CA and one certificate it signed, for servers and clients alike."""

    ca: Path
    cert: Path
    key: Path

    def security(self, token: str = TOKEN, client_cert: bool = True) -> Security:
        return Security(
            token,
            self.cert.read_bytes() if client_cert else None,
            self.key.read_bytes() if client_cert else None,
            self.ca.read_bytes(),
        )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_certificates(folder: Path, addresses: Sequence[str] = ()) -> Certificates:
    """A CA and a certificate it signed for this host's names and 127.0.0.1, and
    for `addresses` (several hosts' addresses: tests/multihost)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("epd test CA"))
        .issuer_name(_name("epd test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    # Peers dial each other as 127.0.0.1 or under this host's name.
    names = [
        x509.DNSName("localhost"),
        x509.DNSName(socket.gethostname()),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        *(x509.IPAddress(ipaddress.ip_address(a)) for a in addresses),
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("epd"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    paths = Certificates(folder / "ca.pem", folder / "cert.pem", folder / "key.pem")
    paths.ca.write_bytes(ca.public_bytes(pem))
    paths.cert.write_bytes(cert.public_bytes(pem))
    paths.key.write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def secured(certificates: Certificates) -> Iterator[None]:
    """This process as a cluster member: the token and mutual TLS, from the
    environment, as `epd` commands set them from their flags."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(env.CLUSTER_TOKEN.name, TOKEN)
        patch.setenv(env.TLS_CERT.name, str(certificates.cert))
        patch.setenv(env.TLS_KEY.name, str(certificates.key))
        patch.setenv(env.TLS_CA.name, str(certificates.ca))
        yield


@dataclass
class Stack:
    broker: BrokerServer
    encoder: EncoderServer
    language: LanguageServer
    gateway: GatewayServer


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def stack(tiny_checkpoint: Path, triton: TritonServer, secured: None) -> AsyncIterator[Stack]:
    broker = await start_broker()
    encoder_ = await start_encoder(tiny_checkpoint, triton, broker)
    language_ = await start_language(
        tiny_checkpoint,
        broker,
        transports=(Transport.GRPC,),  # the data plane over the same TLS channels
        engine=EngineConfig(max_model_len=512, kv_cache_bytes=32 << 20),
    )
    gateway = GatewayServer(
        GatewayConfig(broker=broker.address, checkpoint=tiny_checkpoint, port=0)
    )
    await gateway.start()
    yield Stack(broker, encoder_, language_, gateway)
    await gateway.stop()
    for server in (language_, encoder_, broker):
        await server.stop()


async def _code(call: object) -> grpc.StatusCode:
    try:
        if hasattr(call, "__aiter__"):
            _ = [m async for m in call]  # type: ignore[attr-defined]
        else:
            await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def _registrations() -> AsyncIterator[broker_pb2.PeerMessage]:
    register = broker_pb2.Register(role=common_pb2.ROLE_LANGUAGE, instance_id="intruder")
    yield broker_pb2.PeerMessage(register=register)
    await asyncio.sleep(10)


async def test_the_stack_serves_over_mutual_tls(stack: Stack) -> None:
    """The openai client through the gateway; every gRPC hop behind it (broker,
    encoder, language, the embeddings' stream) with the token over mutual TLS."""
    png = encode_image(random_image(96, 80, seed=3))
    image = "data:image/png;base64," + base64.b64encode(png).decode()
    client = AsyncOpenAI(base_url=stack.gateway.url + "/v1", api_key="-", max_retries=0)
    reply = await client.chat.completions.create(
        model=MODEL,
        max_tokens=4,
        temperature=0,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "text", "text": "What is it?"},
                ],
            }
        ],
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.prompt_tokens > 20  # the image's tokens


async def test_calls_without_the_token_are_unauthenticated(
    stack: Stack, certificates: Certificates
) -> None:
    """Over TLS with a good certificate, but no token (then a wrong one): every
    internal method says UNAUTHENTICATED; health and reflection stay open."""
    for security in (certificates.security(token=""), certificates.security(token="guess")):
        channels = [channel(s.address, security) for s in (stack.broker, stack.encoder)]
        channels.append(channel(stack.language.address, security))
        broker = broker_pb2_grpc.BrokerStub(channels[0])
        assert await _code(broker.Attach(_registrations())) == grpc.StatusCode.UNAUTHENTICATED
        route = broker.Route(broker_pb2.RouteRequest(model=MODEL))
        assert await _code(route) == grpc.StatusCode.UNAUTHENTICATED
        listing = broker.ListInstances(broker_pb2.ListInstancesRequest())
        assert await _code(listing) == grpc.StatusCode.UNAUTHENTICATED
        encode = encoder_pb2_grpc.EncoderStub(channels[1]).Encode(
            encoder_pb2.EncodeRequest(images=[encode_image(random_image(32, 32, seed=1))])
        )
        assert await _code(encode) == grpc.StatusCode.UNAUTHENTICATED
        generate = language_pb2_grpc.LanguageStub(channels[2]).Generate(
            language_pb2.GenerateRequest(request_id="x")
        )
        assert await _code(generate) == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channels[0])
        answer = await health.Check(health_pb2.HealthCheckRequest())
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        for ch in channels:
            await ch.close()
    assert stack.broker.broker.registry.get("intruder") is None
    assert "epd.v1.Broker" in await asyncio.to_thread(list_services, stack.broker.address)


async def test_a_client_without_a_certificate_is_refused(
    stack: Stack, certificates: Certificates
) -> None:
    """Mutual TLS: the token is not enough without a certificate from the CA, and
    plaintext does not get through at all."""
    listing = broker_pb2.ListInstancesRequest()
    securities = (certificates.security(client_cert=False), Security(TOKEN), None)
    no_cert, plain, member = (channel(stack.broker.address, s) for s in securities)
    for refused in (no_cert, plain):
        call = broker_pb2_grpc.BrokerStub(refused).ListInstances(listing, timeout=5)
        assert await _code(call) == grpc.StatusCode.UNAVAILABLE
    assert (await broker_pb2_grpc.BrokerStub(member).ListInstances(listing)).instances


async def test_grpcurl_with_the_ca_a_certificate_and_the_token(
    stack: Stack, certificates: Certificates
) -> None:
    """The README's grpcurl flags, with the real grpcurl."""
    tls = ["-cacert", str(certificates.ca), "-cert", str(certificates.cert)]
    tls += ["-key", str(certificates.key)]
    token = ["-H", f"authorization: Bearer {TOKEN}"]
    method = [stack.broker.address, "epd.v1.Broker/ListInstances"]
    listed = await asyncio.to_thread(grpcurl, *tls, *token, *method)
    assert listed.returncode == 0, listed.stderr
    assert len(json.loads(listed.stdout)["instances"]) == 2
    without_cert = await asyncio.to_thread(
        grpcurl, "-cacert", str(certificates.ca), *token, *method
    )
    assert without_cert.returncode != 0 and "Failed to dial" in without_cert.stderr
    without_token = await asyncio.to_thread(grpcurl, *tls, *method)
    assert "Code: Unauthenticated" in without_token.stderr


async def test_list_instances_shows_endpoints_only_to_members(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    listing = broker_pb2.ListInstancesRequest(role=common_pb2.ROLE_LANGUAGE)
    member = channel(stack.broker.address)
    (instance,) = (await broker_pb2_grpc.BrokerStub(member).ListInstances(listing)).instances
    pool = instance.registration.pool
    assert [e for e in ("shm", "nixl", "cuda_ipc", "grpc") if pool.HasField(e)] == ["grpc"]
    for var in (env.CLUSTER_TOKEN, env.TLS_CERT, env.TLS_KEY, env.TLS_CA):
        monkeypatch.delenv(var.name)  # a broker with no token: nobody is a member
    open_broker = BrokerServer(BrokerConfig(port=0))
    await open_broker.start()
    try:
        await attach(open_broker, language("L"))
        outsider = channel(open_broker.address)
        (shown,) = (await broker_pb2_grpc.BrokerStub(outsider).ListInstances(listing)).instances
        assert shown.registration.instance_id == "L"
        assert shown.registration.pool.num_blocks == 16
        hidden = shown.registration.pool
        assert not any(hidden.HasField(e) for e in ("shm", "nixl", "cuda_ipc", "grpc"))
    finally:
        await open_broker.stop()


async def test_a_live_instance_id_cannot_be_taken_over(secured: None) -> None:
    broker = await start_broker()
    try:
        first = await attach(broker, encoder("E", model=MODEL))
        session = broker.broker.registry.get("E")
        register = broker_pb2.Register(
            role=common_pb2.ROLE_ENCODER, instance_id="E", grpc_address="evil:1", model=MODEL
        )

        async def takeover() -> AsyncIterator[broker_pb2.PeerMessage]:
            yield broker_pb2.PeerMessage(register=register)
            await asyncio.sleep(10)

        ch = channel(broker.address)
        stub = broker_pb2_grpc.BrokerStub(ch)
        assert await _code(stub.Attach(takeover())) == grpc.StatusCode.ALREADY_EXISTS
        assert broker.broker.registry.get("E") is session
        await attach(broker, language("L", model=MODEL))
        route = await stub.Route(broker_pb2.RouteRequest(model=MODEL, needs_encoder=True))
        assert route.encoder_address == "E:1"
        await first.link.close()
        # Once its stream is gone, the id is free again (an instance that restarts).
        again = await attach(broker, encoder("E", model=MODEL))
        assert broker.broker.registry.get("E") is not session
        await again.link.close()
    finally:
        await broker.stop()


async def test_only_the_routed_encoder_speaks_for_a_request(secured: None) -> None:
    """Another encoder's metadata and abort for a request are answered with an
    Abort to it alone: the language instance hears nothing from it, and the
    routed pair goes on."""
    broker = await start_broker()
    try:
        lang = await attach(broker, language("L"))
        encoders = {e: await attach(broker, encoder(e)) for e in ("E1", "E2")}
        await wait_for(lambda: all(p.received for p in encoders.values()))
        ch = channel(broker.address)
        route = await broker_pb2_grpc.BrokerStub(ch).Route(
            broker_pb2.RouteRequest(request_id="r", needs_encoder=True)
        )
        routed = encoders[route.encoder_id]
        (stranger,) = (p for e, p in encoders.items() if e != route.encoder_id)

        def meta() -> EmbeddingMeta:
            return EmbeddingMeta(
                "r", "L", 64, (MediaGrid(1, 16, 16),), (Plane("embeddings", 8),), torch.float32
            )

        stranger.link.send(meta())
        stranger.link.send(Abort("r", "forged"))
        await wait_for(lambda: stranger.of(Abort))
        assert stranger.of(Abort)[0].reason == f"the request is on encoder {route.encoder_id}"
        lang.link.send(Prealloc("r", (1,), 256))
        routed.link.send(meta())
        await wait_for(lambda: lang.of(EmbeddingMeta) and routed.of(Prealloc))
        assert [m.encoder_instance_id for m in lang.of(EmbeddingMeta)] == [route.encoder_id]
        assert not lang.of(Abort)
        pairing = broker.broker.rendezvous.describe("r")
        assert pairing is not None and pairing.phase.name == "TRANSFERRING"
        for peer in (lang, *encoders.values()):
            await peer.link.close()
    finally:
        await broker.stop()


async def test_security_needs_a_key_with_its_certificate(certificates: Certificates) -> None:
    with pytest.raises(ValueError, match="both a certificate and its key"):
        Security(TOKEN, cert=certificates.cert.read_bytes())
