// The chat page: multi-turn history, tokens streamed from /v1/chat/completions (server-sent
// events), a stop button (aborting the request cancels the generation on the server), and the
// decode speed under each answer: live while streaming, the server's own figure at the end.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];          // [{role, content}] of finished turns
let controller = null;       // AbortController of the generation in flight

const SETTINGS = ["system", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                  "presence_penalty", "max_tokens", "seed", "api_key", "json_mode", "json_schema"];
for (const k of SETTINGS) {  // settings survive a reload (a checkbox's as "true" / "false")
  const el = $(k), box = el.type === "checkbox";
  const saved = localStorage.getItem("cflow." + k);
  if (saved !== null) { if (box) el.checked = saved === "true"; else el.value = saved; }
  el.addEventListener("change", () => localStorage.setItem("cflow." + k, box ? String(el.checked) : el.value));
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

function setStats(div, text) {
  let s = div.querySelector(".stats");
  if (!s) { s = document.createElement("div"); s.className = "stats"; div.appendChild(s); }
  s.textContent = text;
}

// JSON mode, following the schema box's schema when it holds one (docs/SERVER.md, "Structured outputs")
function responseFormat() {
  if (!$("json_mode").checked) return undefined;
  const text = $("json_schema").value.trim();
  if (!text) return { type: "json_object" };
  let schema;
  try { schema = JSON.parse(text); } catch (e) { throw new Error("the JSON schema is not JSON: " + e.message); }
  return { type: "json_schema", json_schema: { name: "page", schema } };
}

function request(messages) {
  const num = (k, int) => { const v = $(k).value.trim(); return v === "" ? undefined : (int ? parseInt(v, 10) : parseFloat(v)); };
  return {
    messages, stream: true,
    temperature: num("temperature"), top_p: num("top_p"), top_k: num("top_k", true), min_p: num("min_p"),
    repetition_penalty: num("repetition_penalty"), frequency_penalty: num("frequency_penalty"),
    presence_penalty: num("presence_penalty"), max_tokens: num("max_tokens", true), seed: num("seed", true),
    response_format: responseFormat(),
  };
}

// Yields the JSON payload of each `data:` event until [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(text) {
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  div.classList.add("streaming");
  const out = div.querySelector(".text");
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(history);

  controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  let answer = "", pieces = 0, firstAt = 0, finish = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(request(messages)), signal: controller.signal,
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || r.status + " " + r.statusText);
    }
    for await (const ev of events(r)) {
      controller.signal.throwIfAborted();  // Stop: no more text, even from an already-read chunk
      if (ev.error) throw new Error(ev.error.message);
      const choice = ev.choices && ev.choices[0];
      if (!choice) continue;
      const piece = (choice.delta && choice.delta.content) || "";
      if (piece) {
        const now = performance.now();
        if (!firstAt) firstAt = now; else pieces++;
        answer += piece;
        out.textContent = answer;
        $("log").scrollTop = $("log").scrollHeight;
        const s = (now - firstAt) / 1000;
        if (s > 0) setStats(div, `${(pieces / s).toFixed(1)} tok/s (live)`);
      }
      if (choice.finish_reason) {
        finish = choice.finish_reason;
        const t = ev.timings;
        if (t) setStats(div, `${t.decode_tok_s.toFixed(1)} tok/s decode · ${t.prompt_tok_s.toFixed(1)} tok/s prompt · finish: ${finish}`);
      }
    }
  } catch (e) {
    if (e.name === "AbortError") setStats(div, (div.querySelector(".stats") ? div.querySelector(".stats").textContent + " · " : "") + "stopped");
    else addMessage("error", "Error: " + e.message);
  } finally {
    div.classList.remove("streaming");
    if (answer) history.push({ role: "assistant", content: answer });
    else if (!finish) history.pop();  // nothing came back: forget the question too
    controller = null;
    $("send").disabled = false; $("stop").disabled = true;
    $("prompt").focus();
  }
}

$("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("ask").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  history.length = 0;
  $("log").textContent = "";
});

fetch("/v1/models", { headers: headers() })
  .then((r) => r.json())
  .then((m) => { $("model").textContent = m.data ? `${m.data[0].id} · context ${m.data[0].n_ctx}` : (m.error ? m.error.message : "?"); })
  .catch(() => { $("model").textContent = "server unreachable"; });
