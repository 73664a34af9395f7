// Sortie console. Plain JavaScript, no build step. Rules this file keeps:
// - the bearer token lives in sessionStorage and travels only in the Authorization
//   header (never in a URL, a cookie or the page);
// - everything shown is set with textContent or attributes through el(); nothing here
//   writes HTML from data;
// - live run updates read the SSE route with fetch (EventSource cannot send headers).
"use strict";

const TOKEN_KEY = "sortie.token";
const RUNS_POLL_MS = 3000;
const INBOX_POLL_MS = 4000;
const STATUSES = [
  "running", "waiting_approval", "waiting_signal", "needs_reconciliation", "cancelling",
  "compensating", "succeeded", "failed", "cancelled",
];
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

// ------------------------------------------------------------------ small helpers

/** Builds an element. attrs: plain attributes, plus `text`, `on<event>`, `class`. */
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "text") node.textContent = String(value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
  return node;
}

/** Replaces a node's children (arrays flattened, null and false skipped). */
function fill(node, ...children) {
  clear(node);
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function pad(n) { return String(n).padStart(2, "0"); }

function when(ms) {
  if (ms === null || ms === undefined) return "—";
  const d = new Date(ms);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
    `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

function duration(ms) {
  if (ms === null || ms === undefined || ms < 0) return "—";
  if (ms < 1000) return `${ms} ms`;
  if (ms < 60000) return `${(ms / 1000).toFixed(1)} s`;
  if (ms < 3600000) return `${Math.floor(ms / 60000)} min ${Math.floor((ms % 60000) / 1000)} s`;
  if (ms < 172800000) return `${Math.floor(ms / 3600000)} h ${Math.floor((ms % 3600000) / 60000)} min`;
  return `${Math.floor(ms / 86400000)} days ${Math.floor((ms % 86400000) / 3600000)} h`;
}

function relative(ms) {
  if (ms === null || ms === undefined) return "";
  const delta = ms - Date.now();
  const text = duration(Math.abs(delta));
  return delta >= 0 ? `in ${text}` : `${text} ago`;
}

function json(value) { return JSON.stringify(value, null, 2); }

/** A value's JSON on one line, cut at 200 characters. */
function shortJson(value) {
  const text = JSON.stringify(value === undefined ? null : value);
  return text.length > 200 ? `${text.slice(0, 199)}…` : text;
}

function badge(status) {
  return el("span", { class: `badge status-${status}`, "data-status": status, text: status.replace(/_/g, " ") });
}

function runLink(runId) {
  return el("a", { href: `#/runs/${encodeURIComponent(runId)}`, class: "mono", text: runId });
}

function notice(kind, text, attrs) {
  return el("div", Object.assign({ class: `notice ${kind}`, role: kind === "error" ? "alert" : "status", text }, attrs || {}));
}

// ------------------------------------------------------------------ the API

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function token() { return sessionStorage.getItem(TOKEN_KEY); }

/** Calls the API; a 401 ends the session unless `keepSession` (the sign-in check). */
async function api(method, path, body, keepSession) {
  const headers = { Authorization: `Bearer ${token() || ""}`, Accept: "application/json" };
  const init = { method, headers, cache: "no-store", credentials: "omit" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (e) {
    throw new ApiError(0, "network", `The gateway did not answer (${e.message}).`);
  }
  const text = await response.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (_) { data = null; }
  if (!response.ok) {
    const err = (data && data.error) || {};
    const error = new ApiError(response.status, err.code || "http_" + response.status,
      err.message || `The gateway answered ${response.status}.`);
    if (response.status === 401 && !keepSession) signOut(error.message);
    throw error;
  }
  return data;
}

/** Reads the run's SSE stream with the bearer header; calls onEvent per event of the
 * history and onDelta per delta (a running step's text, outside the history), reconnects. */
function follow(runId, after, onEvent, onState, onDelta) {
  const control = new AbortController();
  let last = after;
  let stopped = false;
  (async () => {
    let backoff = 500;
    while (!stopped) {
      try {
        const response = await fetch(
          `/v1/runs/${encodeURIComponent(runId)}/events/stream?after=${last}`,
          { headers: { Authorization: `Bearer ${token() || ""}`, Accept: "text/event-stream" },
            signal: control.signal, cache: "no-store", credentials: "omit" });
        if (response.status === 401) { signOut("The session ended."); return; }
        if (response.status === 404) { onState("gone"); return; }
        if (!response.ok || !response.body) throw new Error(`stream answered ${response.status}`);
        onState("live");
        backoff = 500;
        const reader = response.body.getReader();
        const decoder = new TextDecoder();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
          let end;
          while ((end = buffer.indexOf("\n\n")) >= 0) {
            const block = buffer.slice(0, end);
            buffer = buffer.slice(end + 2);
            const lines = block.split("\n");
            const data = lines.filter((l) => l.startsWith("data:"))
              .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
            if (!data) continue;
            const event = JSON.parse(data);
            if (lines.some((l) => l.replace(/\s+$/, "") === "event: delta")) {
              if (onDelta) onDelta(event);
              continue;
            }
            if (typeof event.seq === "number" && event.seq > last) {
              last = event.seq;
              onEvent(event);
            }
          }
        }
      } catch (e) {
        if (stopped) return;
      }
      if (stopped) return;
      onState("reconnecting");
      await new Promise((r) => setTimeout(r, backoff));
      backoff = Math.min(backoff * 2, 8000);
    }
  })();
  return () => { stopped = true; control.abort(); };
}

// ------------------------------------------------------------------ session and routing

let me = null;
let teardown = [];

function onLeave(fn) { teardown.push(fn); }

function leave() {
  for (const fn of teardown) { try { fn(); } catch (_) { /* already gone */ } }
  teardown = [];
}

function every(ms, fn) {
  const id = setInterval(fn, ms);
  onLeave(() => clearInterval(id));
}

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  me = null;
  if (message) sessionStorage.setItem("sortie.message", message);
  if (location.hash !== "#/login") location.hash = "#/login";
  else route();
}

async function whoAmI(signingIn) {
  if (me || !token()) return me;
  me = await api("GET", "/v1/me", undefined, signingIn);
  return me;
}

function showChrome(page) {
  const signedIn = !!me;
  document.getElementById("nav").hidden = !signedIn;
  document.getElementById("who").hidden = !signedIn;
  if (signedIn) {
    const roles = me.roles.length ? me.roles.join(", ") : "no roles";
    document.getElementById("who-name").textContent = `${me.principal} · ${me.tenant} · ${roles}`;
  }
  for (const a of document.querySelectorAll("[data-nav]")) {
    a.classList.toggle("active", a.dataset.nav === page);
  }
}

async function refreshInboxCount() {
  if (!me) return;
  try {
    const inbox = await api("GET", "/v1/inbox");
    const mine = inbox.items.filter((i) => i.may_decide).length;
    const count = document.getElementById("inbox-count");
    count.hidden = mine === 0;
    count.textContent = String(mine);
  } catch (_) { /* the page shows errors; the badge stays as it was */ }
}

async function route() {
  leave();
  const main = clear(document.getElementById("main"));
  const hash = location.hash || "#/runs";
  const parts = hash.slice(2).split("/").map(decodeURIComponent);
  if (!token() || parts[0] === "login") {
    me = null;
    showChrome("login");
    return loginPage(main);
  }
  try {
    await whoAmI();
  } catch (e) {
    if (e.status !== 401) main.append(notice("error", e.message));
    return;
  }
  showChrome(parts[0]);
  refreshInboxCount();
  every(INBOX_POLL_MS * 2, refreshInboxCount);
  if (parts[0] === "runs" && parts[1]) return runPage(main, parts[1]);
  if (parts[0] === "inbox") return inboxPage(main);
  if (parts[0] === "operator") return operatorPage(main);
  return runsPage(main);
}

// ------------------------------------------------------------------ sign in

function loginPage(main) {
  const message = sessionStorage.getItem("sortie.message");
  sessionStorage.removeItem("sortie.message");
  const input = el("input", { id: "login-token", type: "password", autocomplete: "off", required: true, spellcheck: "false" });
  const status = el("div", { id: "login-status" });
  const form = el("form", { class: "card login", id: "login-form" },
    el("h1", { text: "Sign in" }),
    el("p", { class: "muted", text: "Paste your bearer token. It is kept in this tab only (session storage) and sent as the Authorization header." }),
    el("label", { for: "login-token", text: "Bearer token" }),
    input,
    el("div", { class: "actions" }, el("button", { type: "submit", id: "login-submit", class: "primary", text: "Sign in" })),
    status);
  if (message) status.append(notice("info", message));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const value = input.value.trim();
    if (!value) return;
    sessionStorage.setItem(TOKEN_KEY, value);
    me = null;
    clear(status);
    try {
      await whoAmI(true);
      location.hash = "#/inbox";
    } catch (e) {
      sessionStorage.removeItem(TOKEN_KEY);
      fill(status, notice("error", e.status === 401 ? "That token is not known to this gateway." : e.message));
    }
  });
  main.append(form);
  input.focus();
}

// ------------------------------------------------------------------ runs list

function runsPage(main) {
  const params = new URLSearchParams(sessionStorage.getItem("sortie.filters") || "");
  const status = el("select", { id: "filter-status" }, el("option", { value: "", text: "any" }),
    STATUSES.map((s) => el("option", { value: s, text: s.replace(/_/g, " ") })));
  status.value = params.get("status") || "";
  const graph = el("input", { id: "filter-graph", type: "text", placeholder: "graph id", value: params.get("graph_id") || "" });
  const label = el("input", { id: "filter-label", type: "text", placeholder: "key=value", value: params.get("label") || "" });
  const since = el("input", { id: "filter-since", type: "datetime-local", value: params.get("since") || "" });
  const until = el("input", { id: "filter-until", type: "datetime-local", value: params.get("until") || "" });
  const result = el("div", { id: "runs-result" });
  const updated = el("span", { class: "muted", id: "runs-updated" });
  const form = el("form", { class: "filters", id: "runs-filters" },
    el("label", {}, "Status", status),
    el("label", {}, "Graph", graph),
    el("label", {}, "Label", label),
    el("label", {}, "Created from", since),
    el("label", {}, "until", until),
    el("button", { type: "submit", text: "Apply" }),
    el("button", { type: "button", class: "link", text: "Clear", onclick: () => {
      status.value = ""; graph.value = ""; label.value = ""; since.value = ""; until.value = "";
      load();
    } }));
  form.addEventListener("submit", (e) => { e.preventDefault(); load(); });
  main.append(el("div", { class: "page-head" }, el("h1", { text: "Runs" }), updated), form, result);

  async function load() {
    const query = new URLSearchParams();
    if (status.value) query.set("status", status.value);
    if (graph.value.trim()) query.set("graph_id", graph.value.trim());
    if (label.value.trim()) query.set("label", label.value.trim());
    const saved = new URLSearchParams(query);
    if (since.value) { query.set("created_after", String(new Date(since.value).getTime())); saved.set("since", since.value); }
    if (until.value) { query.set("created_before", String(new Date(until.value).getTime())); saved.set("until", until.value); }
    sessionStorage.setItem("sortie.filters", saved.toString());
    query.set("limit", "200");
    try {
      const list = await api("GET", `/v1/runs?${query}`);
      renderRuns(result, list.runs, list.next_after);
      updated.textContent = `Updated ${when(Date.now())} · refreshes every ${RUNS_POLL_MS / 1000} s`;
    } catch (e) {
      fill(result, notice("error", e.message));
    }
  }
  load();
  every(RUNS_POLL_MS, load);
}

function labelsText(labels) {
  return Object.entries(labels || {}).map(([k, v]) => `${k}=${v}`).join(" ");
}

function renderRuns(target, runs, more) {
  if (!runs.length) {
    fill(target, el("p", { class: "empty", text: "No runs match." }));
    return;
  }
  runs = runs.slice().sort((a, b) => b.created_at - a.created_at);
  const table = el("table", { class: "runs", id: "runs-table" },
    el("thead", {}, el("tr", {}, ["Run", "Graph", "Status", "Steps done", "Waiting approvals", "Labels", "Created", "Updated"]
      .map((h) => el("th", { text: h })))),
    el("tbody", {}, runs.map((r) => el("tr", { "data-run-id": r.run_id },
      el("td", {}, runLink(r.run_id)),
      el("td", { text: `${r.graph_id} v${r.graph_version}` }),
      el("td", {}, badge(r.status)),
      el("td", { class: "num", text: r.steps_done }),
      el("td", { class: "num", text: r.open_interrupts || "" }),
      el("td", { class: "mono small labels", text: labelsText(r.labels) }),
      el("td", { text: when(r.created_at) }),
      el("td", { text: when(r.updated_at) })))));
  fill(target, table);
  if (more) target.append(el("p", { class: "muted", text: "Showing the first 200 runs; narrow the filters to see others." }));
}

// ------------------------------------------------------------------ run page

function eventKind(event) { return Object.keys(event.body || {})[0] || "?"; }

function roleText(role) {
  if (!role || role === "Node") return "";
  if (role.Compensation) return `compensates ${role.Compensation.of}`;
  if (role.Requested) return `requested by ${role.Requested.by}`;
  if (role.Substitute) return `instead of ${role.Substitute.for_node}`;
  return "";
}

/** A signal event as one readable line (null for other kinds). `waitSignal` names the
 * signal of a wait by its step id, for the events that carry only the step. */
function signalLine(kind, b, waitSignal) {
  if (kind === "SignalWaitOpened") {
    const what = b.many ? `up to ${b.wanted} signals` : "signal";
    return `waiting for ${what} ${b.signal} at ${b.node}` +
      (b.expires_at ? ` until ${when(b.expires_at)}` : "");
  }
  if (kind === "SignalReceived") return `signal ${b.signal} ${b.signal_id} from ${b.sent_by}`;
  if (kind === "SignalBuffered") {
    return `kept signal ${b.signal} ${b.signal_id} from ${b.sent_by} until its wait opens`;
  }
  if (kind === "SignalWaitExpired") {
    const name = waitSignal && waitSignal.get(b.step_id);
    return `${name ? `signal ${name}: ` : ""}deadline passed (${b.on_timeout})`;
  }
  return null;
}

/** Attempts, approvals, compensations and signals, folded from the run's events. */
function timeline(events) {
  const attempts = [];
  const byKey = new Map();
  const approvals = [];
  const interrupts = new Map();
  const signals = [];
  const waitSignal = new Map();
  for (const event of events) {
    const kind = eventKind(event);
    const b = event.body[kind];
    if (kind === "SignalWaitOpened") waitSignal.set(b.step_id, b.signal);
    const line = signalLine(kind, b, waitSignal);
    if (line !== null) {
      signals.push({ kind, at: event.at, text: line, payload: b.payload });
    } else if (kind === "StepDispatched") {
      const a = { step_id: b.step_id, node: b.node, attempt: b.attempt, tool: b.tool,
        side_effect: b.side_effect, role: b.role, started: event.at, ended: null,
        outcome: "in flight", detail: "", operation_id: event.operation_id };
      attempts.push(a);
      byKey.set(`${b.step_id}#${b.attempt}`, a);
    } else if (kind === "StepSucceeded" || kind === "StepFailed" || kind === "StepOutcomeUnknown") {
      const a = byKey.get(`${b.step_id}#${b.attempt}`);
      if (!a) continue;
      a.ended = event.at;
      if (kind === "StepSucceeded") { a.outcome = "succeeded"; }
      if (kind === "StepFailed") {
        a.outcome = b.retryable && b.retry_at ? "failed, will retry" : "failed";
        a.detail = `${b.code}: ${b.message}`;
      }
      if (kind === "StepOutcomeUnknown") {
        a.outcome = b.needs_operator ? "unknown — needs an operator" : "unknown, will retry";
        a.detail = b.message;
      }
    } else if (kind === "OperationReconciled") {
      const last = attempts.filter((a) => a.step_id === b.step_id).pop();
      if (last) {
        last.ended = last.ended || event.at;
        last.outcome = b.succeeded ? "succeeded (reconciled)" : "failed (reconciled)";
        last.detail = `recorded by ${b.by}${b.error ? ": " + b.error : ""}`;
      }
    } else if (kind === "Interrupted") {
      const entry = { interrupt_id: b.interrupt_id, node: b.node, proposal_hash: b.proposal_hash,
        proposal: b.proposal, reason: b.reason, opened: event.at, decisions: [], outcome: "waiting" };
      interrupts.set(b.interrupt_id, entry);
      approvals.push(entry);
    } else if (kind === "InterruptDecided") {
      const entry = interrupts.get(b.interrupt_id);
      if (entry) {
        entry.decisions.push({ by: b.decided_by, at: event.at, approve: b.approve,
          hash: b.proposal_hash, comment: b.comment, payload: b.payload, edited_args: b.edited_args });
        if (b.is_final) entry.outcome = b.approve ? "approved" : "rejected";
      }
    } else if (kind === "InterruptExpired") {
      const entry = interrupts.get(b.interrupt_id);
      if (entry) entry.outcome = `expired (${b.on_timeout})`;
    } else if (kind === "InterruptEscalated") {
      const entry = interrupts.get(b.interrupt_id);
      if (entry) entry.outcome = `escalated to ${b.approver_group}`;
    }
  }
  return { attempts, approvals, signals };
}

function runPage(main, runId) {
  const events = [];
  let run = null;
  let turns = [];
  const head = el("div", { class: "page-head" });
  const live = el("span", { class: "live", id: "live-state", text: "connecting…" });
  const summary = el("div", { id: "run-summary" });
  const pending = el("section", { id: "run-pending" });
  const waits = el("section", { id: "run-waits" });
  const signalLog = el("section", { id: "run-signals" });
  const steps = el("section", { id: "run-steps" });
  const conversation = el("section", { id: "run-conversation" });
  const writingView = el("section", { id: "run-writing" });
  // What running steps have written so far, by step: the latest execution's text, until
  // the step's result arrives (the result is the truth; ADR 0031).
  const writing = new Map();
  const settled = new Set();
  const approvals = el("section", { id: "run-approvals" });
  const compensations = el("section", { id: "run-compensations" });
  const checkpoint = el("section", { id: "run-checkpoint" });
  const log = el("section", { id: "run-events" });
  const messages = el("div", { id: "run-messages" });
  const data = el("section", { id: "run-data" });
  const why = el("section", { id: "run-why" });
  main.append(head, messages, pending, waits, summary, writingView, conversation, steps, signalLog, why, approvals, compensations, data,
    checkpoint, log);

  let scheduled = null;
  function refresh() {
    if (scheduled) return;
    scheduled = setTimeout(async () => {
      scheduled = null;
      try {
        run = await api("GET", `/v1/runs/${encodeURIComponent(runId)}`);
        const talk = await api("GET", `/v1/runs/${encodeURIComponent(runId)}/conversation`);
        turns = talk.entries;
        render();
      } catch (e) {
        fill(messages, notice("error", e.status === 404 ? `Run ${runId} does not exist.` : e.message));
      }
    }, 150);
  }
  onLeave(() => clearTimeout(scheduled));

  function render() {
    if (!run) return;
    const cancellable = !TERMINAL.has(run.status) && run.status !== "cancelling";
    fill(head, 
      el("h1", {}, "Run ", el("span", { class: "mono", text: run.run_id })),
      el("span", { id: "run-status" }, badge(run.status)),
      live,
      cancellable ? el("button", { type: "button", class: "danger", id: "run-cancel", text: "Cancel run…",
        onclick: () => confirmCancel(run.run_id, messages, refresh) }) : null);
    fill(summary, el("dl", { class: "facts" },
      fact("Graph", `${run.graph_id} v${run.graph_version}`),
      fact("Started by", run.started_by),
      fact("Created", when(run.created_at)),
      fact("Updated", when(run.updated_at)),
      fact("Steps done", `${run.steps_done} (${run.nodes_completed.join(" → ") || "none yet"})`),
      fact("Labels", labelsText(run.labels) || "none"),
      run.parent ? fact("Parent run", el("span", { id: "run-parent" },
        runLink(run.parent.run_id), ` (step ${run.parent.step_id})`)) : null,
      run.children && run.children.length ? fact("Child runs", el("ul", { class: "plain", id: "run-children" },
        run.children.map((c) => el("li", {}, runLink(c.run_id), ` · ${c.node} · ${c.status}`)))) : null,
      run.ending ? fact(run.ending.cancelled ? "Cancelled" : "Ending", run.ending.reason) : null));
    fill(data, el("h2", { text: "Input and output" }), el("dl", { class: "facts" },
      fact("Input", el("pre", { class: "json", text: json(run.input) })),
      fact("Output", run.output !== null && run.output !== undefined
        ? el("pre", { class: "json", text: json(run.output) }) : el("span", { class: "muted", text: "none yet" }))));
    clear(pending);
    if (run.interrupts.length) {
      pending.append(el("h2", { text: "Waiting for approval" }),
        ...run.interrupts.map((i) => el("div", { class: "card" },
          el("p", {}, `Node `, el("strong", { text: i.node }), ` · proposal `, el("span", { class: "mono small", text: i.proposal_hash })),
          el("p", { text: i.reason }),
          el("pre", { class: "json", text: json(i.proposal.args) }),
          el("a", { href: "#/inbox", text: "Decide in the approval inbox →" }))));
    }
    renderWaits();
    if (turns.length) {
      fill(conversation, el("h2", { text: "Conversation" }), conversationView(turns));
    } else {
      clear(conversation);
    }
    const { attempts, approvals: decided, signals } = timeline(events);
    const now = Date.now();
    const normal = attempts.filter((a) => !(a.role && a.role.Compensation));
    const undo = attempts.filter((a) => a.role && a.role.Compensation);
    fill(steps, el("h2", { text: "Timeline" }), attemptsTable(normal, now, "steps-table"));
    fill(approvals, el("h2", { text: "Approvals" }), decided.length
      ? el("table", { class: "approvals", id: "approvals-table" },
        el("thead", {}, el("tr", {}, ["Node", "Opened", "Proposal", "Decisions", "Outcome"].map((h) => el("th", { text: h })))),
        el("tbody", {}, decided.map((a) => el("tr", {},
          el("td", { text: a.node }),
          el("td", { text: when(a.opened) }),
          el("td", {}, el("span", { class: "mono small", title: a.proposal_hash, text: a.proposal_hash.slice(0, 16) + "…" })),
          el("td", {}, a.decisions.length ? el("ul", { class: "plain" }, a.decisions.map((d) => el("li", {},
            el("strong", { text: d.approve ? "approved" : "rejected" }), ` by ${d.by} at ${when(d.at)}`,
            d.hash !== a.proposal_hash ? " (another proposal)" : "",
            d.comment ? el("span", { class: "muted", text: ` — “${d.comment}”` }) : null,
            d.edited_args !== null && d.edited_args !== undefined ? el("span", { class: "muted", text: " · with edited arguments" }) : null,
            d.payload !== null && d.payload !== undefined ? el("span", { class: "muted decision-input", text: ` · input ${JSON.stringify(d.payload)}` }) : null))) : "—"),
          el("td", {}, el("span", { class: `outcome ${a.outcome.split(" ")[0]}`, text: a.outcome }))))))
      : el("p", { class: "empty", text: "No approval gate reached." }));
    if (signals.length) {
      fill(signalLog, el("h2", { text: "Signals" }), el("ol", { class: "events signals", id: "signals-list" },
        signals.map((s) => el("li", { "data-kind": s.kind },
          el("span", { class: "muted", text: `${when(s.at)} ` }),
          el("span", { class: "signal-line", text: s.text }),
          s.payload !== undefined ? el("code", { class: "small signal-payload-shown", text: ` ${shortJson(s.payload)}` }) : null))));
    } else {
      clear(signalLog);
    }
    fill(compensations, el("h2", { text: "Compensations" }), undo.length
      ? attemptsTable(undo, now, "compensations-table")
      : el("p", { class: "empty", text: "None ran." }));
    renderCheckpointPicker();
    const wasOpen = !!log.querySelector("details[open]");
    fill(log, el("details", { open: wasOpen }, el("summary", { text: `All events (${events.length})` }),
      el("ol", { class: "events", start: 1 }, events.map((e) => {
        const line = signalLine(eventKind(e), e.body[eventKind(e)]);
        return el("li", {},
          el("span", { class: "muted", text: `#${e.seq} ${when(e.at)} ` }), el("strong", { text: eventKind(e) }),
          line ? el("span", { class: "event-line", text: ` — ${line}` }) : null,
          el("pre", { class: "json small", text: json(e.body[eventKind(e)]) }));
      }))));
  }

  // One card per open wait, kept across redraws so a payload or a message being written
  // survives the run's events (the cards are re-attached only when the set of open waits
  // changes). A conversation's wait for the person's next message gets a message box;
  // any other wait the form for a JSON payload.
  const waitCards = new Map();
  function renderWaits() {
    const open = run.open_waits && run.open_waits.length
      ? (run.waits || []).filter((w) => w.status === "open") : [];
    for (const id of Array.from(waitCards.keys())) {
      if (!open.some((w) => w.step_id === id)) waitCards.delete(id);
    }
    if (!open.length) { clear(waits); return; }
    const cards = open.map((w) => {
      if (!waitCards.has(w.step_id)) waitCards.set(w.step_id, w.conversation ? messageCard(w) : waitCard(w));
      const card = waitCards.get(w.step_id);
      card.update(w);
      return card.node;
    });
    const shown = Array.from(waits.querySelectorAll(":scope > .wait"));
    if (shown.length !== cards.length || shown.some((n, i) => n !== cards[i])) {
      const heading = open.every((w) => w.conversation) ? "Waiting for a message" : "Waiting for signals";
      fill(waits, el("h2", { text: heading }), cards);
    }
  }

  /** The message box of a conversation that waits for the person's next message: the
   * model's last answer, a text to send as `{text}`, or the end of the conversation. */
  function messageCard(wait) {
    const name = wait.signal;
    const facts = el("dl", { class: "facts" });
    const answered = el("div", { class: "last-answer" });
    const text = el("textarea", { class: "message-text", rows: "3",
      "aria-label": `Your message to ${wait.node}`,
      placeholder: "Write your message (Ctrl+Enter sends it)" });
    const send = el("button", { type: "submit", class: "primary send-message", text: "Send" });
    const end = el("button", { type: "button", class: "end-conversation", text: "End conversation" });
    const result = el("div", { class: "message-result" });
    const form = el("form", { class: "message-form" },
      el("h3", { text: "Your message" }), text,
      el("div", { class: "actions" }, send, end),
      result);
    // Writing clears the page's own "the message is empty" (a gateway's refusal stays).
    text.addEventListener("input", () => {
      if (result.querySelector(".code-empty")) clear(result);
    });
    text.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        form.requestSubmit();
      }
    });
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const said = text.value.trim();
      if (!said) {
        result.replaceChildren(notice("error", "Not sent: the message is empty. Write something, or end the conversation.",
          { class: "notice error message-refusal code-empty" }));
        text.focus();
        return;
      }
      deliver({ text: said }, "Your message");
    });
    end.addEventListener("click", () => deliver({ end: true }, "The end of the conversation"));

    async function deliver(payload, what) {
      // A fresh id per message: a retried request is a duplicate, never a second message.
      const body = { payload, signal_id: freshId("msg") };
      send.disabled = true;
      end.disabled = true;
      result.replaceChildren(notice("info", "Sending…"));
      try {
        const answer = await api("POST",
          `/v1/runs/${encodeURIComponent(runId)}/signals/${encodeURIComponent(name)}`, body);
        const how = {
          taken: payload.end ? "taken: the conversation ends" : "taken: the model answers next",
          kept: "kept: the conversation takes it when it waits for the next message",
          duplicate: "a duplicate: it was taken already; nothing changed",
        }[answer.signal] || answer.signal;
        const said = `${what} was ${how}. The run is ${answer.status.replace(/_/g, " ")}.`;
        fill(messages, notice("ok", said, { class: `notice ok message-answer signal-${answer.signal}` }));
        result.replaceChildren(notice("ok", said));
        text.value = "";
      } catch (e) {
        result.replaceChildren(notice("error", `Not sent (${e.code}): ${e.message}`,
          { class: `notice error message-refusal code-${e.code}` }));
      } finally {
        send.disabled = false;
        end.disabled = false;
      }
      refresh();
    }

    const node = el("article", { class: "card wait conversation-wait", "data-signal": name, "data-step": wait.step_id },
      el("h3", {}, "Conversation with ", el("strong", { class: "mono", text: wait.node }),
        el("span", { class: "muted", text: ` · signal ${name}` })),
      answered, facts, form);
    function update(w) {
      const last = turns.filter((t) => t.kind === "model" && t.step_id === w.step_id && t.text).pop();
      if (last) {
        fill(answered, el("span", { class: "who who-model", text: "model" }),
          el("div", { class: "turn-text", text: last.text }));
      } else {
        clear(answered);
      }
      fill(facts,
        fact("Waits until", w.expires_at ? `${when(w.expires_at)} (${relative(w.expires_at)})` : "no deadline"));
    }
    return { node, update };
  }

  function waitCard(wait) {
    const name = wait.signal;
    const facts = el("dl", { class: "facts" });
    const payload = el("textarea", { class: "signal-payload", rows: "4", spellcheck: "false",
      "aria-label": `Payload of signal ${name} (JSON)` });
    payload.value = "{}";
    const signalId = el("input", { type: "text", class: "signal-id", maxlength: "128", autocomplete: "off",
      spellcheck: "false", "aria-label": "Signal id (optional)",
      placeholder: "Signal id (optional): your id of the event; a signal id is taken once" });
    const send = el("button", { type: "submit", class: "primary send-signal", text: "Send" });
    const result = el("div", { class: "signal-result" });
    const form = el("form", { class: "signal-form" },
      el("h3", { text: `Send signal ${name}` }),
      el("label", { text: "Payload (JSON)" }), payload,
      el("label", { text: "Signal id (optional)" }), signalId,
      el("div", { class: "actions" }, send),
      result);
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const body = {};
      try { body.payload = JSON.parse(payload.value); } catch (e) {
        result.replaceChildren(notice("error", `The payload is not valid JSON: ${e.message}`,
          { class: "notice error signal-refusal code-bad_json" }));
        return;
      }
      if (signalId.value.trim()) body.signal_id = signalId.value.trim();
      send.disabled = true;
      result.replaceChildren(notice("info", "Sending…"));
      try {
        const answer = await api("POST",
          `/v1/runs/${encodeURIComponent(runId)}/signals/${encodeURIComponent(name)}`, body);
        const what = {
          taken: "taken",
          kept: "kept: the wait has not opened yet; it takes the signal when it does",
          duplicate: "duplicate: a signal with this id was taken already; nothing changed",
        }[answer.signal] || answer.signal;
        const text = `Signal ${name} ${answer.signal_id}: ${what}. The run is ${answer.status.replace(/_/g, " ")}.`;
        fill(messages, notice("ok", text, { class: `notice ok signal-answer signal-${answer.signal}` }));
        result.replaceChildren(notice("ok", text));
      } catch (e) {
        result.replaceChildren(notice("error", `Not sent (${e.code}): ${e.message}`,
          { class: `notice error signal-refusal code-${e.code}` }));
      } finally {
        send.disabled = false;
      }
      refresh();
    });
    const node = el("article", { class: "card wait", "data-signal": name, "data-step": wait.step_id },
      el("h3", {}, "Signal ", el("strong", { class: "mono signal-name", text: name }),
        el("span", { class: "muted", text: ` · node ${wait.node}` })),
      facts, form);
    function update(w) {
      const got = w.received || [];
      fill(facts,
        fact("Deadline", w.expires_at ? `${when(w.expires_at)} (${relative(w.expires_at)})` : "none"),
        fact(w.many ? `Taken (${got.length} of ${w.wanted})` : "Taken", got.length
          ? el("ul", { class: "plain signals-taken" }, got.map((r) => el("li", {},
            el("span", { class: "mono small", text: r.signal_id }), ` from ${r.sent_by} at ${when(r.at)} `,
            el("code", { class: "small", text: shortJson(r.payload) }))))
          : el("span", { class: "muted", text: "nothing yet" })));
    }
    return { node, update };
  }

  function attemptsTable(rows, now, id) {
    if (!rows.length) return el("p", { class: "empty", text: "No steps dispatched yet." });
    return el("table", { class: "steps", id },
      el("thead", {}, el("tr", {}, ["Step", "Attempt", "Tool", "Side effect", "Started", "Duration", "Outcome"].map((h) => el("th", { text: h })))),
      el("tbody", {}, rows.map((a) => el("tr", { "data-step": a.step_id },
        el("td", {}, el("strong", { text: a.node }), " ", el("span", { class: "muted small", text: roleText(a.role) })),
        el("td", { class: "num", text: a.attempt }),
        el("td", { text: a.tool }),
        el("td", {}, el("span", { class: `effect effect-${a.side_effect}`, text: a.side_effect })),
        el("td", { text: when(a.started) }),
        el("td", { class: "num", text: a.ended ? duration(a.ended - a.started) : `${duration(now - a.started)}…` }),
        el("td", {}, el("span", { class: `outcome ${a.outcome.split(/[ ,]/)[0]}`, text: a.outcome }),
          a.detail ? el("div", { class: "muted small", text: a.detail }) : null,
          a.operation_id ? el("button", { type: "button", class: "link why", "data-operation-id": a.operation_id,
            text: "why?", onclick: () => showWhy(a.operation_id) }) : null)))));
  }

  /** The verified authorization chain of one side effect (GET …/operations/{op}/why). */
  async function showWhy(operationId) {
    fill(why, el("h2", { text: "Why did this happen?" }), el("p", { class: "muted", text: "Checking every link…" }));
    try {
      const chain = await api("GET", `/v1/runs/${encodeURIComponent(runId)}/operations/${encodeURIComponent(operationId)}/why`);
      fill(why, el("h2", { text: "Why did this happen?" }),
        el("p", {}, el("span", { class: "mono small", text: chain.operation_id }), " — ",
          el("strong", { id: "why-verdict", text: chain.verified ? "every link verified" : "the chain does not hold" })),
        el("ol", { class: "why-links" }, chain.links.map((l) => el("li", { "data-link": l.link, "data-status": l.status },
          el("strong", { text: l.link }), " ", el("span", { class: `outcome ${l.status === "verified" ? "succeeded" : "failed"}`, text: l.status }),
          (l.problems || []).length ? el("ul", { class: "plain" }, l.problems.map((p) => el("li", { class: "muted", text: p }))) : null,
          el("pre", { class: "json small", text: json(l.facts) })))));
    } catch (e) {
      fill(why, el("h2", { text: "Why did this happen?" }), notice("error", e.message));
    }
  }

  let pickerBuilt = false;
  const select = el("select", { id: "checkpoint-version" });
  const stateView = el("div", { id: "checkpoint-state" });
  function renderCheckpointPicker() {
    if (!pickerBuilt) {
      pickerBuilt = true;
      checkpoint.append(el("h2", { text: "State at a checkpoint" }),
        el("form", { class: "filters", onsubmit: (e) => { e.preventDefault(); showCheckpoint(); } },
          el("label", {}, "Version", select), el("button", { type: "submit", text: "Show state" })),
        stateView);
    }
    const chosen = select.value;
    fill(select, ...Array.from({ length: run.version }, (_, i) => run.version - i)
      .map((v) => el("option", { value: v, text: v === run.version ? `${v} (latest)` : String(v) })));
    if (chosen) select.value = chosen;
  }
  async function showCheckpoint() {
    const id = `ckpt_${runId}_${select.value}`;
    fill(stateView, el("p", { class: "muted", text: "Loading…" }));
    try {
      const cp = await api("GET", `/v1/runs/${encodeURIComponent(runId)}/checkpoints/${encodeURIComponent(id)}`);
      fill(stateView, el("dl", { class: "facts" },
        fact("Checkpoint", el("span", { class: "mono", text: cp.checkpoint_id })),
        fact("Status then", badge(cp.status)),
        fact("Nodes completed", cp.nodes_completed.join(" → ") || "none"),
        fact("State", el("pre", { class: "json", text: json(cp.state) }))));
    } catch (e) {
      fill(stateView, notice("error", e.message));
    }
  }

  function renderWriting() {
    if (!writing.size) { clear(writingView); return; }
    fill(writingView, el("h2", { text: "Writing now" }), ...[...writing.entries()].map(([step, w]) =>
      el("div", { class: "card writing", "data-step": step },
        el("p", {}, el("strong", { text: w.node }), el("span", { class: "muted small", text: ` ${step} · attempt ${w.attempt}` }),
          w.status ? el("span", { class: "muted small writing-status", text: ` · ${w.status}` }) : null),
        el("div", { class: "turn-text writing-text", text: w.text }))));
  }

  const stop = follow(runId, 0, (event) => {
    events.push(event);
    const body = event.body ? Object.values(event.body)[0] : null;
    const kind = event.body ? Object.keys(event.body)[0] : "";
    if (body && body.step_id && ["StepSucceeded", "StepFailed", "StepOutcomeUnknown"].includes(kind)) {
      settled.add(`${body.step_id}/${body.attempt}`);
      const w = writing.get(body.step_id);
      if (w && w.attempt === body.attempt) { writing.delete(body.step_id); renderWriting(); }
    }
    refresh();
  }, (state) => {
    live.textContent = state === "live" ? "● live" : state === "gone" ? "" : "reconnecting…";
    live.className = `live ${state}`;
  }, (delta) => {
    if (settled.has(`${delta.step_id}/${delta.attempt}`)) return;
    let w = writing.get(delta.step_id);
    if (!w || w.execution !== delta.execution_id) {
      w = { execution: delta.execution_id, node: delta.node, attempt: delta.attempt, text: "", status: "", seq: 0 };
      writing.set(delta.step_id, w);
    }
    if (delta.seq <= w.seq) return;
    w.seq = delta.seq;
    if (delta.kind === "status") w.status = delta.text; else w.text += delta.text;
    renderWriting();
  });
  onLeave(stop);
  refresh();
}

/** An agent's conversation: what it was told, what the model answered and asked for,
 * approvals as asked and decided, and what each tool answered, in order. */
function conversationView(entries) {
  const call = (c) => el("div", { class: "call" },
    el("code", { class: "call-text", text: `${c.tool}(${JSON.stringify(c.arguments)})` }),
    c.id ? el("span", { class: "muted small", text: ` ${c.id}` }) : null);
  return el("ol", { class: "conversation", id: "conversation-list" }, entries.map((e) => {
    let who; let body;
    if (e.kind === "message") {
      who = e.role;
      body = [el("div", { class: "turn-text", text: e.text })];
    } else if (e.kind === "model") {
      who = "model";
      body = [e.text ? el("div", { class: "turn-text", text: e.text }) : null,
        ...e.tool_calls.map(call),
        e.usage && e.usage.prompt_tokens !== undefined ? el("div", { class: "muted small",
          text: `${e.usage.prompt_tokens} prompt + ${e.usage.completion_tokens} completion tokens` }) : null];
    } else if (e.kind === "approval") {
      who = "approval";
      body = [el("div", { class: "turn-text" }, el("strong", { text: e.tool }), ` ${e.state}`,
        e.by ? ` by ${e.by}` : "", e.comment ? el("span", { class: "muted", text: ` — “${e.comment}”` }) : null)];
    } else {
      who = "tool";
      body = [el("div", { class: "turn-head" }, el("strong", { text: e.tool }), " ",
        el("span", { class: `outcome ${e.status.split(/[ ,]/)[0]}`, text: e.status })),
      el("pre", { class: "turn-text result", text: e.text })];
    }
    return el("li", { class: `turn turn-${e.kind}`, "data-kind": e.kind, "data-step": e.step_id || "" },
      el("span", { class: `who who-${who}`, text: who }),
      el("div", { class: "turn-body" }, ...body),
      el("span", { class: "muted small when", text: when(e.at) }));
  }));
}

/** A fresh random id (`<prefix>-<uuid>`); crypto.randomUUID needs a secure context. */
function freshId(prefix) {
  if (typeof crypto.randomUUID === "function") return `${prefix}-${crypto.randomUUID()}`;
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return `${prefix}-${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}

function fact(name, value) {
  return [el("dt", { text: name }), el("dd", {}, value)];
}

// ------------------------------------------------------------------ cancel dialog

function confirmCancel(runId, messages, after) {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-title").textContent = `Cancel run ${runId}?`;
  document.getElementById("confirm-text").textContent =
    "No new step starts. Steps already running report their real outcome (cancelling is not undo); " +
    "completed steps that declare a compensation are undone in reverse order.";
  const reason = document.getElementById("confirm-reason");
  reason.value = "";
  dialog.returnValue = "";
  dialog.addEventListener("close", async function onClose() {
    dialog.removeEventListener("close", onClose);
    if (dialog.returnValue !== "ok") return;
    const body = reason.value.trim() ? { reason: reason.value.trim() } : {};
    try {
      const answer = await api("POST", `/v1/runs/${encodeURIComponent(runId)}/cancel`, body);
      fill(messages, notice("ok", `Run ${runId}: ${answer.status}.`));
    } catch (e) {
      fill(messages, notice("error", `Cancel refused (${e.code}): ${e.message}`));
    }
    after();
  });
  dialog.showModal();
}

// ------------------------------------------------------------------ approval inbox

// What an approval's step affects: tool, node, side-effect class, and the change from the
// proposal it replaces when an approver edited the arguments.
function affects(item) {
  const a = item.affects || {};
  const text = `${a.tool || "?"} on ${a.node || item.node}` + (a.side_effect ? ` (${a.side_effect})` : "");
  const diff = a.diff && Object.keys(a.diff).length
    ? el("ul", { class: "plain affects-diff" }, Object.entries(a.diff).map(([k, d]) =>
      el("li", {}, el("code", { text: k }), `: ${JSON.stringify(d.from)} → ${JSON.stringify(d.to)}`)))
    : null;
  return el("span", {}, el("span", { class: "affects", text }),
    diff ? el("span", { class: "muted", text: " · edited from an earlier proposal:" }) : null, diff,
    item.precheck ? el("span", { class: "muted precheck", text: ` · rechecked by ${item.precheck} after approval` }) : null);
}

function inboxPage(main) {
  const list = el("div", { id: "inbox-list" });
  const flash = el("div", { id: "inbox-flash" });
  const updated = el("span", { class: "muted", id: "inbox-updated" });
  main.append(el("div", { class: "page-head" }, el("h1", { text: "Approval inbox" }), updated,
    el("button", { type: "button", text: "Refresh", onclick: () => load(true) })), flash, list);
  let busy = false;
  // The last refusal per interrupt, so a redraw does not hide it.
  const refusals = new Map();

  async function load(force) {
    // Never redraw under someone who is editing or typing a comment.
    if (!force && (busy || list.querySelector(".editing") || list.contains(document.activeElement))) return;
    try {
      const inbox = await api("GET", "/v1/inbox");
      renderInbox(inbox.items);
      updated.textContent = `Updated ${when(Date.now())}`;
    } catch (e) {
      fill(list, notice("error", e.message));
    }
  }

  function renderInbox(items) {
    clear(list);
    if (!items.length) {
      list.append(el("p", { class: "empty", id: "inbox-empty", text: "Nothing waits for a decision." }));
      return;
    }
    for (const item of items) list.append(card(item));
  }

  function card(item) {
    const args = item.proposal && item.proposal.args !== undefined ? item.proposal.args : item.proposal;
    const comment = el("input", { type: "text", class: "comment", maxlength: "1000", "aria-label": "Comment",
      placeholder: "Comment (recorded with the decision)" });
    const input = el("textarea", { class: "human-input", rows: "2", spellcheck: "false", "aria-label": "Input for the step",
      placeholder: "Input for the step (JSON, optional): delivered to the node as $interrupt.payload" });
    const editor = el("textarea", { class: "edit-args", rows: "8", spellcheck: "false" });
    editor.value = json(args);
    const editBox = el("div", { class: "edit-box", hidden: true },
      el("label", { text: "Edited arguments (JSON). Approving sends them as edited_args; unless the node allows edits, an edited call becomes a new proposal that needs its own approval." }),
      editor,
      el("div", { class: "actions" },
        el("button", { type: "button", class: "primary approve-edited", text: "Approve with these arguments", onclick: () => {
          let payload;
          try { payload = JSON.parse(editor.value); } catch (e) {
            result.replaceChildren(notice("error", `The edited arguments are not valid JSON: ${e.message}`));
            return;
          }
          decide("approve", payload);
        } }),
        el("button", { type: "button", class: "link", text: "Discard edits", onclick: () => {
          editBox.hidden = true; node.classList.remove("editing"); editor.value = json(args);
        } })));
    const result = el("div", { class: "decision-result" });
    if (refusals.has(item.interrupt_id)) result.append(refusals.get(item.interrupt_id));
    const node = el("article", { class: "card inbox-item", "data-run-id": item.run_id, "data-interrupt-id": item.interrupt_id,
      "data-may-decide": String(item.may_decide) },
      el("header", { class: "item-head" },
        el("h2", {}, el("span", { text: item.node }), " in ", runLink(item.run_id)),
        el("span", { class: "muted", text: `${item.graph_id} v${item.graph_version}` })),
      el("dl", { class: "facts" },
        fact("Why it needs approval", item.reason || "not given"),
        // The model message below says it already when it is the rationale.
        item.model_message && item.model_message.text === item.rationale ? null
          : fact("Agent's rationale", item.rationale ? el("span", { class: "rationale", text: item.rationale })
            : el("span", { class: "rationale not-given", text: "not given" })),
        item.model_message ? fact("Model message", el("div", { class: "model-message" },
          el("div", { class: "model-text", text: item.model_message.text || "(no text, only the call)" }),
          item.model_message.tool_call ? el("code", { class: "model-call",
            text: `${item.model_message.tool_call.tool}(${JSON.stringify(item.model_message.tool_call.arguments)})` }) : null,
          el("span", { class: "muted small", text: ` asked by ${item.model_message.step_id}` }))) : null,
        fact("What it affects", affects(item)),
        fact("If rejected", item.on_reject ? el("span", { class: "on-reject", text: item.on_reject })
          : el("span", { class: "on-reject not-given", text: "not given" })),
        fact("Opened", `${when(item.opened_at)} (${relative(item.opened_at)})`),
        fact("Expires", item.expires_at ? `${when(item.expires_at)} (${relative(item.expires_at)})` : "never"),
        fact("Needs", `${item.required_role ? `role ${item.required_role}` : "any role"}` +
          (item.approver_group && item.members_only ? ` · a member of ${item.approver_group}` : "") +
          (item.quorum > 1 ? ` · ${item.approvals.length} of ${item.quorum} approvals` : "")),
        fact("Proposal", el("span", { class: "mono small proposal-hash", text: item.proposal_hash }))),
      el("h3", { text: `Proposed call: ${item.proposal.tool || ""}` }),
      el("pre", { class: "json proposal-args", text: json(args) }),
      item.may_decide ? null : el("div", { class: "notice warn why-not", role: "note" },
        el("strong", { text: "You may not decide this: " }), el("span", { class: "why-not-text", text: item.why_not || "" })),
      comment,
      input,
      el("div", { class: "actions" },
        el("button", { type: "button", class: "primary approve", text: "Approve", onclick: () => decide("approve") }),
        el("button", { type: "button", class: "danger reject", text: "Reject", onclick: () => decide("reject") }),
        el("button", { type: "button", class: "edit", text: "Edit arguments…", onclick: () => {
          editBox.hidden = false; node.classList.add("editing"); editor.focus();
        } })),
      editBox,
      result);

    async function decide(decision, edited) {
      const body = { decision, interrupt_id: item.interrupt_id, proposal_hash: item.proposal_hash };
      if (edited !== undefined) body.edited_args = edited;
      if (input.value.trim()) {
        try { body.payload = JSON.parse(input.value); } catch (e) {
          result.replaceChildren(notice("error", `The input is not valid JSON: ${e.message}`));
          return;
        }
      }
      if (comment.value.trim()) body.comment = comment.value.trim();
      busy = true;
      for (const b of node.querySelectorAll("button")) b.disabled = true;
      result.replaceChildren(notice("info", "Sending…"));
      try {
        const answer = await api("POST", `/v1/runs/${encodeURIComponent(item.run_id)}/resume`, body);
        const verb = decision === "approve" ? "Approved" : "Rejected";
        let text = `${verb} ${item.node} in run ${item.run_id}; the run is ${answer.status.replace(/_/g, " ")}.`;
        if (edited !== undefined) {
          text += " The call was edited: unless the node allows edits, the edited call is a new proposal that waits for its own approval.";
        }
        flash.replaceChildren(notice("ok", text, { class: "notice ok decided" }));
        refusals.delete(item.interrupt_id);
        node.remove();
      } catch (e) {
        let text;
        if (e.code === "stale_proposal" || e.code === "unknown_interrupt" || e.code === "already_decided" || e.code === "expired") {
          text = `This proposal is stale (${e.code}): ${e.message}. Refresh to see what waits now.`;
        } else if (e.code === "bad_state" || e.code === "unknown_run") {
          text = `This approval is no longer open (${e.code}): ${e.message}. Refresh to see what waits now.`;
        } else if (e.status === 403) {
          text = `Refused (${e.code}): ${e.message}`;
        } else {
          text = `Not decided (${e.code}): ${e.message}`;
        }
        const shown = notice("error", text, { class: `notice error refusal code-${e.code}` });
        refusals.set(item.interrupt_id, shown);
        result.replaceChildren(shown);
        for (const b of node.querySelectorAll("button")) b.disabled = false;
      } finally {
        busy = false;
        refreshInboxCount();
      }
    }
    return node;
  }

  load(true);
  every(INBOX_POLL_MS, () => load(false));
}

// ------------------------------------------------------------------ operator page

function operatorPage(main) {
  const flash = el("div", { id: "operator-flash" });
  const unknown = el("section", { id: "operator-reconcile" });
  const active = el("section", { id: "operator-active" });
  main.append(el("div", { class: "page-head" }, el("h1", { text: "Operator" }),
    el("button", { type: "button", text: "Refresh", onclick: load })), flash, unknown, active);

  async function load() {
    try {
      const stuck = await api("GET", "/v1/runs?status=needs_reconciliation&limit=100");
      const runs = await Promise.all(stuck.runs.map((r) => api("GET", `/v1/runs/${encodeURIComponent(r.run_id)}`)));
      fill(unknown, el("h2", { text: "Outcomes to record" }),
        el("p", { class: "muted", text: "These runs wait because a step's outcome is unknown and its side effect cannot be retried safely. Check the receiver, then record what really happened." }));
      const forms = runs.flatMap((run) => run.steps.filter((s) => s.status === "needs_operator").map((s) => reconcileForm(run, s)));
      unknown.append(...(forms.length ? forms : [el("p", { class: "empty", text: "No run needs reconciliation." })]));
    } catch (e) {
      fill(unknown, notice("error", e.message));
    }
    try {
      const lists = await Promise.all(["running", "waiting_approval", "waiting_signal", "needs_reconciliation", "compensating"]
        .map((s) => api("GET", `/v1/runs?status=${s}&limit=100`)));
      const runs = lists.flatMap((l) => l.runs);
      fill(active, el("h2", { text: "Runs in progress" }), runs.length
        ? el("table", { class: "runs", id: "operator-runs" },
          el("thead", {}, el("tr", {}, ["Run", "Graph", "Status", "Updated", ""].map((h) => el("th", { text: h })))),
          el("tbody", {}, runs.map((r) => el("tr", { "data-run-id": r.run_id },
            el("td", {}, runLink(r.run_id)),
            el("td", { text: `${r.graph_id} v${r.graph_version}` }),
            el("td", {}, badge(r.status)),
            el("td", { text: when(r.updated_at) }),
            el("td", {}, el("button", { type: "button", class: "danger small cancel", text: "Cancel…",
              onclick: () => confirmCancel(r.run_id, flash, load) }))))))
        : el("p", { class: "empty", text: "Nothing in progress." }));
    } catch (e) {
      fill(active, notice("error", e.message));
    }
  }

  function reconcileForm(run, step) {
    const outcome = el("select", { class: "outcome-select" },
      el("option", { value: "", text: "choose…" }),
      el("option", { value: "succeeded", text: "it succeeded" }),
      el("option", { value: "failed", text: "it failed" }));
    const result = el("textarea", { rows: "4", class: "result", spellcheck: "false", placeholder: '{"id": "…"} — what the receiver answered' });
    const error = el("input", { type: "text", class: "error-text", placeholder: "what went wrong (when it failed)" });
    const status = el("div", {});
    const form = el("form", { class: "card reconcile", "data-run-id": run.run_id, "data-operation-id": step.operation_id },
      el("h3", {}, runLink(run.run_id), ` · ${step.node} (attempt ${step.attempt})`),
      el("dl", { class: "facts" },
        fact("Operation", el("span", { class: "mono small", text: step.operation_id })),
        fact("Tool", `${step.tool} · ${step.side_effect}`),
        fact("Arguments", el("pre", { class: "json", text: json(step.args) })),
        step.error ? fact("Last error", step.error) : null),
      el("label", {}, "Real outcome ", outcome),
      el("label", { text: "Result (JSON, optional)" }), result,
      el("label", { text: "Error (optional)" }), error,
      el("div", { class: "actions" }, el("button", { type: "submit", class: "primary", text: "Record outcome" })),
      status);
    form.addEventListener("submit", async (e) => {
      e.preventDefault();
      if (!outcome.value) { status.replaceChildren(notice("error", "Choose what really happened.")); return; }
      const body = { outcome: outcome.value };
      if (result.value.trim()) {
        try { body.result = JSON.parse(result.value); } catch (err) {
          status.replaceChildren(notice("error", `The result is not valid JSON: ${err.message}`));
          return;
        }
      }
      if (error.value.trim()) body.error = error.value.trim();
      try {
        await api("POST", `/v1/runs/${encodeURIComponent(run.run_id)}/operations/${encodeURIComponent(step.operation_id)}/reconcile`, body);
        flash.replaceChildren(notice("ok", `Recorded: ${step.node} in ${run.run_id} ${outcome.value}.`));
        load();
      } catch (err) {
        status.replaceChildren(notice("error", `Refused (${err.code}): ${err.message}`));
      }
    });
    return form;
  }

  load();
}

// ------------------------------------------------------------------ start

document.getElementById("sign-out").addEventListener("click", () => signOut("Signed out."));
window.addEventListener("hashchange", route);
route();
