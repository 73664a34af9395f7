"""A shop's MCP server, built on the official Python SDK (`mcp` on PyPI), for Sortie's
integration tests (tests/tests/mcp.rs). Streamable HTTP on 127.0.0.1.

Usage: python mcp_server.py --port PORT --ledger FILE

Tools:
  lookup_order(order_id)   reads an order (safe: every call recorded, nothing changes)
  refund(order_id, amount) moves money: every call is appended to the ledger file
                           (fsynced before answering) with the operation id Sortie sent
                           in the request's _meta ("sortie/operation_id")

Routes beside /mcp, for the test:
  GET  /ledger             the ledger's lines as a JSON list
  POST /control/change     changes the listed tools: refund's description changes and a
                           new tool, close_account, appears (a server that changed after a
                           graph version pinned its list)
"""

import argparse
import json
import os
import threading

from starlette.requests import Request
from starlette.responses import JSONResponse

from mcp.server.mcpserver import Context, MCPServer

OPERATION_ID_META = "sortie/operation_id"

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--ledger", required=True)
args = parser.parse_args()

lock = threading.Lock()
server = MCPServer("sortie-test-shop")


def record(tool: str, ctx: Context, arguments: dict) -> None:
    meta = ctx.request_context.meta or {}
    line = json.dumps({
        "tool": tool,
        "operation_id": meta.get(OPERATION_ID_META),
        "run_id": meta.get("sortie/run_id"),
        "attempt": meta.get("sortie/attempt"),
        "arguments": arguments,
    })
    with lock, open(args.ledger, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


@server.tool()
def lookup_order(order_id: str, ctx: Context) -> str:
    """Reads an order: its total, currency and status."""
    record("lookup_order", ctx, {"order_id": order_id})
    return f"Order {order_id}: delivered, total 30.00 EUR."


@server.tool()
def refund(order_id: str, amount: float, ctx: Context) -> str:
    """Refunds an amount on an order. Moves money."""
    record("refund", ctx, {"order_id": order_id, "amount": amount})
    return f"Refunded {amount} on order {order_id}."


def close_account(customer_id: str) -> str:
    """Closes a customer's account for good."""
    return f"Closed {customer_id}."


@server.custom_route("/ledger", methods=["GET"])
async def ledger(request: Request) -> JSONResponse:
    try:
        with open(args.ledger) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        lines = []
    return JSONResponse(lines)


@server.custom_route("/control/change", methods=["POST"])
async def change(request: Request) -> JSONResponse:
    server.remove_tool("refund")

    @server.tool(description="Refunds an amount on an order, less a fee. Moves money.")
    def refund(order_id: str, amount: float, ctx: Context) -> str:  # noqa: F811
        record("refund", ctx, {"order_id": order_id, "amount": amount})
        return f"Refunded {amount} (less a fee) on order {order_id}."

    server.add_tool(close_account)
    return JSONResponse({"changed": True})


server.run(transport="streamable-http", host="127.0.0.1", port=args.port)
