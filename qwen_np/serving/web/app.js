// qwen_np's page: the explorer (one traced forward pass of a prompt, from /explorer/*) and the playground
// (streamed /v1 completions and chats). Plain JS, no framework, nothing loaded from elsewhere. Model text is
// only ever written with textContent, never parsed as HTML.
"use strict";

// Everything the page shows, as the server sent it: the browser tests read their numbers here.
const state = { model: null, info: null, ids: null, analysis: null, attention: null, heatmap: null,
                filter: null, chosen: null, play: null, mask: null, mask_settings: null, runs: 0 };
window.qwenExplorer = state;

const $ = (id) => document.getElementById(id);
const el = (tag, { dataset = {}, ...props } = {}, ...children) => {
  const node = Object.assign(document.createElement(tag), props);
  Object.assign(node.dataset, dataset);
  node.append(...children);
  return node;
};

// --- talking to serve ------------------------------------------------------------------------------

function headers() {
  const key = sessionStorage.getItem("qwen_np_api_key");
  return Object.assign({ "Content-Type": "application/json" }, key ? { Authorization: `Bearer ${key}` } : {});
}

async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try { message = (await response.json()).error.message; } catch (_) { /* not OpenAI's error JSON */ }
  if (response.status === 401) $("key-box").hidden = false;
  return new Error(message);
}

async function api(path, body) {
  const response = await fetch(path, body === undefined ? { headers: headers() }
    : { method: "POST", headers: headers(), body: JSON.stringify({ model: state.model, ...body }) });
  if (!response.ok) throw await failure(response);
  return response.json();
}

function report(error) { $("status").textContent = error ? String(error.message || error) : ""; }

async function guarded(work) {
  try { report(null); await work(); } catch (error) { report(error); }
}

// --- shared pieces ----------------------------------------------------------------------------------

// A token's text with its whitespace made visible; a token holding part of a UTF-8 character shows its bytes.
function tokenLabel(token) {
  if (token.text === null) return `⟨${token.bytes}⟩`;
  return token.text.replace(/ /g, "␣").replace(/\n/g, "\\n").replace(/\t/g, "\\t").replace(/\r/g, "\\r") || "∅";
}

const fmt = (x) => (x === null || x === undefined ? "—" : Math.abs(x) >= 1e4 || (x !== 0 && Math.abs(x) < 1e-3)
  ? x.toExponential(3) : x.toPrecision(4));
const percent = (p) => (p === null ? "—" : p >= 0.001 ? `${(100 * p).toFixed(1)}%` : p.toExponential(1));

// The sampling fields of /v1/completions, as sliders; sampling.py's rules apply to each.
const SAMPLING = [
  { name: "temperature", label: "temperature", min: 0, max: 2, step: 0.05 },
  { name: "top_k", label: "top-k", min: 0, max: 100, step: 1 },
  { name: "top_p", label: "top-p", min: 0.01, max: 1, step: 0.01 },
  { name: "min_p", label: "min-p", min: 0, max: 1, step: 0.01 },
  { name: "repetition_penalty", label: "repetition penalty", min: 0.5, max: 2, step: 0.05 },
];

function samplingControls(box, prefix, defaults, onchange) {
  for (const field of SAMPLING) {
    const input = el("input", { type: "range", id: `${prefix}-${field.name}`, min: field.min, max: field.max,
                                step: field.step, value: defaults[field.name] ?? field.min });
    const shown = el("output", { htmlFor: input.id, textContent: input.value });
    input.addEventListener("input", () => { shown.textContent = input.value; if (onchange) onchange(); });
    box.append(el("label", { htmlFor: input.id }, field.label, input, shown));
  }
  return () => Object.fromEntries(SAMPLING.map((field) => [field.name, Number($(`${prefix}-${field.name}`).value)]));
}

// --- explorer -----------------------------------------------------------------------------------------

let filterSettings = null;

async function explore() {
  const text = $("explore-prompt").value;
  state.analysis = await api("/explorer/analyze", { prompt: state.ids ?? text });
  state.ids = state.analysis.tokens.map((token) => token.id);
  state.chosen = null;
  $("explore-prompt").value = state.analysis.text;
  $("explore-out").hidden = false;
  showTokens(state.analysis.tokens);
  showFlow(state.analysis);
  showLens(state.analysis);
  showSteps(state.analysis.steps);
  await Promise.all([showAttention(), showFilter()]);
  state.runs += 1;                                 // every view shows this prompt now
}

function showTokens(tokens) {
  $("tokens").replaceChildren(...tokens.map((token, position) => el("li",
    { title: `position ${position}, id ${token.id}, bytes ${token.bytes}`, dataset: { id: token.id, bytes: token.bytes } },
    el("span", { className: token.text === null ? "partial" : "text", textContent: tokenLabel(token) }),
    el("span", { className: "id", textContent: token.id }))));
}

// --- the flow: the last token's vector through the model ---

function divergingColour(t) {                    // -1 blue, 0 white, +1 red
  const a = Math.round(255 - 200 * Math.min(1, Math.abs(t)));
  return t >= 0 ? `rgb(255, ${a}, ${a})` : `rgb(${a}, ${a}, 255)`;
}

// values as one row of cells: width per value chosen so that a row is at most ~560 px where it can be
function drawStrip(canvas, values, colour) {
  const cell = Math.max(1, Math.floor(560 / values.length)), height = 18, scale = window.devicePixelRatio || 1;
  canvas.width = values.length * cell * scale;
  canvas.height = height * scale;
  canvas.style.width = `${values.length * cell}px`;
  canvas.style.height = `${height}px`;
  const g = canvas.getContext("2d");
  g.scale(scale, scale);
  values.forEach((v, i) => { g.fillStyle = colour(v); g.fillRect(i * cell, 0, cell, height); });
  return cell;
}

function stripNode(label, what, values, link, readout) {
  const largest = Math.max(...values.map(Math.abs)) || 1;
  const rms = Math.sqrt(values.reduce((sum, v) => sum + v * v, 0) / values.length);
  const canvas = el("canvas", { className: "strip", role: "img" });
  canvas.setAttribute("aria-label", `${label}: ${values.length} values, largest |x| ${fmt(largest)}`);
  const cell = drawStrip(canvas, values, (v) => divergingColour(v / largest));
  const value = el("span", { className: "muted readout" });
  canvas.addEventListener("mousemove", (event) => {
    const i = Math.floor((event.clientX - canvas.getBoundingClientRect().left) / cell);
    if (i >= 0 && i < values.length) value.textContent = readout(i, values[i]);
  });
  const title = el("div", { className: "node-title" }, el("strong", { textContent: label }),
    el("span", { className: "muted", textContent: ` ${what} · ${values.length} values, RMS ${fmt(rms)}, max|x| ${fmt(largest)} ` }));
  if (link) title.append(el("a", { href: link, className: "doc", textContent: "walkthrough" }));
  return el("div", { className: "node" }, title, el("div", { className: "scroll" }, canvas), value);
}

const FLOW_WHAT = { "model.embed_tokens": "the token's row of the embedding table", "self_attn.o_proj": "what attention adds",
  residual_attn: "the stream after attention", "mlp.down_proj": "what the MLP adds", residual_mlp: "the stream after the layer",
  "model.norm": "the final RMSNorm, what lm_head reads" };

function showFlow(analysis) {
  const links = state.info.links.steps, arrow = () => el("div", { className: "arrow", textContent: "↓" });
  const node = (row) => stripNode(row.name.replace(/^model\.layers\.\d+\./, ""), FLOW_WHAT[row.step.replace(/^model\.layers\.\{i\}\./, "")] || "",
    row.values, links[row.step], (i, v) => `dimension ${i}: ${fmt(v)}`);
  const parts = [];
  const layers = new Map();
  for (const row of analysis.flow) {
    if (row.layer === null) { parts.push(node(row)); continue; }
    if (!layers.has(row.layer)) {
      const box = el("details", { className: "flow-layer", open: row.layer === 0 },
        el("summary", { textContent: `layer ${row.layer}: attention, then the MLP, each added to the stream` }));
      layers.set(row.layer, box);
      parts.push(box);
    }
    layers.get(row.layer).append(node(row));
  }
  const bins = analysis.probability_bins, top = analysis.model_top.map((t) => `${tokenLabel(t)} ${percent(t.p)}`).join(", ");
  const largest = Math.max(...bins.max) || 1;
  const probabilities = stripNode("probabilities", `softmax(lm_head(x)): the largest of each ${bins.ids_per_bin} ids; top: ${top}`,
    bins.max, state.info.links.steps.lm_head, (i, p) => `ids ${i * bins.ids_per_bin}-${(i + 1) * bins.ids_per_bin - 1}: up to ${percent(p)}`);
  drawStrip(probabilities.querySelector("canvas"), bins.max, (p) => weightColour(p / largest));
  parts.push(probabilities);
  $("flow").replaceChildren(...parts.flatMap((part, i) => (i ? [arrow(), part] : [part])));
}

function showLens(analysis) {
  const rows = [...analysis.lens, { label: "model", top: analysis.model_top }];
  const head = el("tr", {}, el("th", { textContent: "after" }),
    ...rows[0].top.map((_, i) => el("th", { textContent: `#${i + 1}` })));
  $("lens").replaceChildren(head, ...rows.map((row) => el("tr", {}, el("td", { textContent: row.label }),
    ...row.top.map((token) => el("td", { className: "tokenish", textContent: `${tokenLabel(token)} ${percent(token.p)}`,
                                         style: `background: rgba(31, 95, 191, ${(0.55 * token.p).toFixed(3)})` })))));
}

function shapeText(row) {
  const numbers = `[${row.shape.join(", ")}]`;
  return row.symbols ? `[${row.symbols.join(", ")}] = ${numbers}` : numbers;
}

function stepRow(row, step) {
  const source = step.source;
  return el("tr", { title: step.what }, el("td", { className: "name", textContent: row.name.replace(/^model\.layers\.\d+\./, "") }),
    el("td", { textContent: shapeText(row) }), el("td", { textContent: fmt(row.mean) }), el("td", { textContent: fmt(row.std) }),
    el("td", { textContent: fmt(row.max_abs) }), el("td", { textContent: row.masked ? row.masked.toLocaleString() : "" }),
    el("td", { textContent: step.what, className: "what" }),
    el("td", { className: "code", textContent: `${source.file}:${source.line}  ${source.code.replace(/\s+#.*$/, "")}` }),
    el("td", {}, state.info.links.steps[row.step] ? el("a", { href: state.info.links.steps[row.step], textContent: "§" }) : ""));
}

function stepTable(rows) {
  const steps = Object.fromEntries(state.info.steps.map((step) => [step.name, step]));
  const head = el("tr", {}, ...["step", "shape", "mean", "std", "max|x|", "masked", "what", "code", "read"].map((h) => el("th", { textContent: h })));
  return el("div", { className: "scroll" }, el("table", { className: "numbers" }, head, ...rows.map((row) => stepRow(row, steps[row.step]))));
}

function showSteps(rows) {
  const groups = [];
  for (const row of rows) {
    const key = row.layer === null ? (groups.length ? "after the layers" : "before the layers") : `layer ${row.layer}`;
    if (!groups.length || groups[groups.length - 1].key !== key) groups.push({ key, rows: [] });
    groups[groups.length - 1].rows.push(row);
  }
  $("steps").replaceChildren(...groups.map((group, i) => el("details", { className: "layer", open: i <= 1 || i === groups.length - 1 },
    el("summary", { textContent: `${group.key} (${group.rows.length} step${group.rows.length > 1 ? "s" : ""})` }), stepTable(group.rows))));
}

// --- attention ---

function weightColour(w) {                      // white at 0 to the accent blue at 1
  const t = Math.max(0, Math.min(1, w));
  return `rgb(${Math.round(255 - 224 * t)}, ${Math.round(255 - 160 * t)}, ${Math.round(255 - 64 * t)})`;
}

const MASKED = "#d9dce2";

function drawGrid(canvas, weights, cell, margin, labels) {
  const T = weights.length;
  const scale = window.devicePixelRatio || 1;
  canvas.width = (margin + T * cell) * scale;
  canvas.height = (margin + T * cell) * scale;
  canvas.style.width = `${margin + T * cell}px`;
  canvas.style.height = `${margin + T * cell}px`;
  const g = canvas.getContext("2d");
  g.scale(scale, scale);
  for (let i = 0; i < T; i++) {
    for (let j = 0; j < T; j++) {
      g.fillStyle = j > i ? MASKED : weightColour(weights[i][j]);     // j > i: the future, masked
      g.fillRect(margin + j * cell, margin + i * cell, cell, cell);
    }
  }
  if (!labels) return;
  g.fillStyle = "#1d1f23";
  g.font = `${Math.min(12, cell)}px ui-monospace, monospace`;
  g.textBaseline = "middle";
  labels.forEach((label, i) => {
    const short = label.length > 10 ? `${label.slice(0, 9)}…` : label;
    g.textAlign = "right";
    g.fillText(short, margin - 4, margin + (i + 0.5) * cell);
    g.save();
    g.translate(margin + (i + 0.5) * cell, margin - 4);
    g.rotate(-Math.PI / 2);
    g.textAlign = "left";
    g.fillText(short, 0, 0);
    g.restore();
  });
}

function showHeatmap() {
  const layer = Number($("att-layer").value), head = Number($("att-head").value);
  const weights = state.attention.weights[head];
  const labels = state.analysis.tokens.map(tokenLabel);
  const T = weights.length, cell = Math.max(8, Math.min(28, Math.floor(560 / T)));
  const canvas = $("heatmap");
  state.heatmap = { layer, head, weights, cell, margin: 84, cursor: [T - 1, 0] };
  Object.assign(canvas.dataset, { layer, head, tokens: T });
  canvas.tabIndex = 0;
  canvas.setAttribute("aria-label", `attention weights of layer ${layer}, head ${head}: ${T} by ${T}; arrow keys move over the cells`);
  drawGrid(canvas, weights, cell, state.heatmap.margin, labels);
  const group = state.info.group_size, kv = state.attention.kv_head[head];
  const sharing = state.attention.kv_head.map((k, h) => (k === kv ? h : null)).filter((h) => h !== null);
  $("gqa").textContent = `Grouped-query attention: ${state.info.dimensions.H} query heads share ${state.info.dimensions.KVH} `
    + `key/value heads, ${group} to each (query head h reads KV head h // ${group}). Head ${head} reads KV head ${kv}, `
    + `as do heads ${sharing.join(", ")}.`;
  document.querySelectorAll(".multiple").forEach((button) => button.setAttribute("aria-pressed", String(Number(button.dataset.head) === head)));
}

function describeCell(i, j) {
  const labels = state.analysis.tokens.map(tokenLabel), w = state.heatmap.weights[i][j];
  $("heat-value").textContent = j > i ? `query ${i} ${labels[i]} cannot see key ${j} ${labels[j]}: the future, masked`
    : `query ${i} ${labels[i]} → key ${j} ${labels[j]}: weight ${w.toPrecision(4)}`;
}

function heatmapCell(event) {
  const { cell, margin, weights } = state.heatmap, box = $("heatmap").getBoundingClientRect();
  const j = Math.floor((event.clientX - box.left - margin) / cell), i = Math.floor((event.clientY - box.top - margin) / cell);
  if (i >= 0 && j >= 0 && i < weights.length && j < weights.length) describeCell(i, j);
}

function heatmapKey(event) {
  const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] }, move = moves[event.key];
  if (!move || !state.heatmap) return;
  event.preventDefault();
  const T = state.heatmap.weights.length, [i, j] = state.heatmap.cursor;
  state.heatmap.cursor = [Math.max(0, Math.min(T - 1, i + move[0])), Math.max(0, Math.min(T - 1, j + move[1]))];
  describeCell(...state.heatmap.cursor);
}

function showMultiples() {
  const kvHeads = [...new Set(state.attention.kv_head)];
  const T = state.attention.weights[0].length, cell = Math.max(1, Math.floor(96 / T));
  $("multiples").replaceChildren(...kvHeads.map((kv) => el("div", { className: "group" },
    el("span", { className: "label", textContent: `KV head ${kv}` }),
    ...state.attention.kv_head.flatMap((k, head) => {
      if (k !== kv) return [];
      const canvas = el("canvas");
      drawGrid(canvas, state.attention.weights[head], cell, 0, null);
      const button = el("button", { type: "button", className: "multiple", dataset: { head }, title: `show head ${head}` },
        canvas, el("span", { textContent: `head ${head}` }));
      button.addEventListener("click", () => { $("att-head").value = head; showHeatmap(); });
      return [button];
    }))));
}

// Answers can arrive out of order (a slider moved twice, a layer picked twice): only the latest is shown.
const latest = { attention: 0, filter: 0 };

async function newest(kind, path, body) {
  const mine = ++latest[kind];
  const answer = await api(path, body);
  return mine === latest[kind] ? answer : null;
}

async function showAttention() {
  const answer = await newest("attention", "/explorer/attention", { prompt: state.ids, layer: Number($("att-layer").value) });
  if (!answer) return;
  state.attention = answer;
  showMultiples();
  showHeatmap();
}

// --- the next token ---

async function showFilter() {
  const settings = filterSettings();
  const answer = await newest("filter", "/explorer/filter", { prompt: state.ids, ...settings });
  if (!answer) return;
  state.filter = { settings, ...answer };
  const stages = state.filter.stages;
  $("filter-counts").textContent = "Tokens kept: " + stages.map((stage) => `${stage.name} ${stage.kept.toLocaleString()}`).join(" → ")
    + `. The ${state.filter.tokens.length} most likely are listed; — marks a token a filter removed.`;
  const head = el("tr", {}, el("th", { textContent: "token" }), el("th", { textContent: "id" }),
    ...stages.map((stage) => el("th", { textContent: `${stage.name} (${stage.kept.toLocaleString()})` })));
  const rows = state.filter.tokens.map((token) => {
    const pick = el("button", { type: "button", className: "tokenish", textContent: tokenLabel(token), title: "choose this token" });
    pick.addEventListener("click", () => choose(token));
    return el("tr", { className: state.chosen && state.chosen.id === token.id ? "chosen" : "", dataset: { id: token.id } },
      el("td", {}, pick), el("td", { textContent: token.id }),
      ...token.p.map((p) => el("td", { className: p === null ? "dropped" : "", textContent: percent(p) })));
  });
  $("filter-table").replaceChildren(head, ...rows);
}

function choose(token) {
  state.chosen = token;
  $("chosen").textContent = `next: ${tokenLabel(token)} (id ${token.id})`;
  $("append").disabled = false;
  document.querySelectorAll("#filter-table tr").forEach((row) => row.classList.toggle("chosen", Number(row.dataset.id) === token.id));
}

async function sample() {
  choose(await api("/explorer/sample", { prompt: state.ids, ...filterSettings(), seed: Math.floor(Math.random() * 2 ** 31) }));
}

async function append() {
  state.ids = [...state.ids, state.chosen.id];
  $("append").disabled = true;
  $("chosen").textContent = "";
  await explore();
}

// --- playground -----------------------------------------------------------------------------------------

let playSettings = null, transcript = [], aborter = null;

const chatMode = () => document.querySelector("input[name=mode]:checked").value === "chat";

function playBody() {
  const body = { stream: true, stream_options: { include_usage: true }, max_tokens: Number($("play-max").value), ...playSettings() };
  if ($("play-seed").value !== "") body.seed = Number($("play-seed").value);
  const stops = $("play-stop").value.split("|").filter((stop) => stop);
  if (stops.length) body.stop = stops;
  if (!chatMode()) return ["/v1/completions", { ...body, prompt: $("play-prompt").value }];
  transcript.push({ role: "user", content: $("play-prompt").value });
  return ["/v1/chat/completions", { ...body, messages: transcript, chat_template_kwargs: { enable_thinking: $("play-thinking").checked } }];
}

// Qwen3 writes its reasoning between <think> and </think> before the answer; a server that splits it
// off sends it as reasoning_content instead. Either way it is shown apart.
function splitThinking(text) {
  const open = text.indexOf("<think>");
  if (open < 0) return { reasoning: "", content: text };
  const close = text.indexOf("</think>", open);
  if (close < 0) return { reasoning: text.slice(open + 7), content: text.slice(0, open) };
  return { reasoning: text.slice(open + 7, close).trim(), content: (text.slice(0, open) + text.slice(close + 8)).replace(/^\s+/, "") };
}

function showReply() {
  const play = state.play, split = splitThinking(play.text);
  play.reasoning = (play.reasoningContent + split.reasoning).trim();
  play.content = split.content;
  $("reply").textContent = play.content;
  $("reasoning").textContent = play.reasoning;
  $("reasoning-box").hidden = !play.reasoning;
}

function showStats() {
  const play = state.play, usage = play.usage;
  if (!usage) return;
  const cached = usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
  const seconds = (play.last - play.first) / 1000, decoded = usage.completion_tokens - 1;
  $("play-stats").textContent = `prompt ${usage.prompt_tokens} tokens` + (cached !== undefined && cached !== null ? ` (${cached} cached)` : "")
    + ` · reply ${usage.completion_tokens} tokens · first after ${((play.first - play.start) / 1000).toFixed(2)} s`
    + (decoded > 0 && seconds > 0 ? ` · ${(decoded / seconds).toFixed(1)} tok/s after it` : "") + ` · finish: ${play.finish}`;
}

function handleEvent(data) {
  const play = state.play;
  if (data.error) throw new Error(data.error.message);
  if (data.usage) play.usage = data.usage;
  for (const choice of data.choices || []) {
    const piece = choice.text ?? (choice.delta && choice.delta.content) ?? "";
    play.reasoningContent += (choice.delta && choice.delta.reasoning_content) || "";
    if (piece) {
      play.first = play.first ?? performance.now();
      play.last = performance.now();
      play.text += piece;
    }
    if (choice.finish_reason) play.finish = choice.finish_reason;
  }
  showReply();
}

async function readStream(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    pending += value;
    const events = pending.split("\n\n");
    pending = events.pop();
    for (const event of events) {
      const data = event.replace(/^data: /, "");
      if (data === "[DONE]") return;
      handleEvent(JSON.parse(data));
    }
  }
}

function showTranscript() {
  $("transcript").replaceChildren(...transcript.map((turn) => el("div", { className: `turn ${turn.role}`, textContent: `${turn.role}: ${turn.content}` })));
  $("transcript").hidden = !transcript.length;
}

// With a JSON schema, a completion goes to /explorer/mask: the reply under the grammar, and each step's mask.
async function playMasked() {
  state.mask_settings = playSettings();
  if ($("play-seed").value !== "") state.mask_settings.seed = Number($("play-seed").value);
  const body = { prompt: $("play-prompt").value, max_tokens: Math.min(Number($("play-max").value), state.info.mask_max_tokens),
                 ...state.mask_settings };
  try { body.json_schema = JSON.parse($("play-schema").value); } catch (error) { throw new Error(`JSON schema: ${error.message}`); }
  state.play = { text: "", reasoningContent: "", usage: null, finish: null, done: false };
  state.mask = null;
  $("play-stats").textContent = "";
  try {
    state.mask = await api("/explorer/mask", body);
    state.play.text = state.mask.text;
    showReply();
    showMask(state.mask);
  } finally {
    state.play.done = true;
  }
}

function showMask(mask) {
  const head = el("tr", {}, ...["step", "token", `allowed (of ${mask.vocab_size.toLocaleString()})`, "p removed", "likeliest removed"]
    .map((h) => el("th", { textContent: h })));
  const rows = mask.steps.map((step, i) => el("tr", {}, el("td", { textContent: i + 1 }),
    el("td", { className: "tokenish", textContent: tokenLabel(step.token) }), el("td", { textContent: step.allowed.toLocaleString() }),
    el("td", { textContent: percent(step.removed_p) }),
    el("td", { className: "tokenish removed", textContent: step.removed.map((t) => `${tokenLabel(t)} ${percent(t.p)}`).join("  ") })));
  $("mask-table").replaceChildren(head, ...rows);
  $("mask-box").hidden = false;
  $("play-stats").textContent = `${mask.steps.length} steps under the grammar · ${mask.complete ? "the JSON is complete" : "stopped at max tokens"}`;
}

async function play() {
  $("mask-box").hidden = true;
  if (!chatMode() && $("play-schema").value.trim()) return playMasked();
  const [path, body] = playBody();
  state.play = { text: "", reasoningContent: "", usage: null, finish: null, start: performance.now(), first: null, last: null, done: false };
  $("play-stats").textContent = "";
  showReply();
  aborter = new AbortController();
  $("play-send").disabled = true;
  $("play-stop-button").disabled = false;
  try {
    const response = await fetch(path, { method: "POST", headers: headers(), signal: aborter.signal,
                                         body: JSON.stringify({ model: state.model, ...body }) });
    if (!response.ok) throw await failure(response);
    await readStream(response);
    if (chatMode()) {
      transcript.push({ role: "assistant", content: state.play.content });
      $("play-prompt").value = "";
    }
  } catch (error) {
    if (chatMode() && transcript.length && transcript[transcript.length - 1].role === "user") transcript.pop();
    if (error.name !== "AbortError") throw error;
  } finally {
    state.play.done = true;
    $("play-send").disabled = false;
    $("play-stop-button").disabled = true;
    showTranscript();
    showStats();
  }
}

function setMode() {
  const chat = chatMode();
  $("thinking-box").hidden = !chat;
  $("play-schema").hidden = chat;
  $("schema-label").hidden = chat;
  $("play-label").firstChild.textContent = chat ? "Your message " : "Text to continue ";
  transcript = [];
  showTranscript();
}

// --- the page -------------------------------------------------------------------------------------------

function selectTab(tab) {
  for (const other of document.querySelectorAll("[role=tab]")) {
    const selected = other === tab;
    other.setAttribute("aria-selected", String(selected));
    other.tabIndex = selected ? 0 : -1;
    $(other.getAttribute("aria-controls")).hidden = !selected;
  }
  tab.focus();
}

function wire() {
  const tabs = [...document.querySelectorAll("[role=tab]")];
  tabs.forEach((tab, i) => {
    tab.addEventListener("click", () => selectTab(tab));
    tab.addEventListener("keydown", (event) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
      if (step) selectTab(tabs[(i + step + tabs.length) % tabs.length]);
    });
  });
  const submitOnCtrlEnter = (textarea, form) => textarea.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); form.requestSubmit(); }
  });
  submitOnCtrlEnter($("explore-prompt"), $("explore-form"));
  submitOnCtrlEnter($("play-prompt"), $("play-form"));
  $("explore-prompt").addEventListener("input", () => { state.ids = null; });     // typed text: tokenise it again
  $("explore-form").addEventListener("submit", (event) => { event.preventDefault(); guarded(explore); });
  $("att-layer").addEventListener("change", () => guarded(showAttention));
  $("att-head").addEventListener("change", () => showHeatmap());
  $("heatmap").addEventListener("mousemove", heatmapCell);
  $("heatmap").addEventListener("keydown", heatmapKey);
  $("sample").addEventListener("click", () => guarded(sample));
  $("append").addEventListener("click", () => guarded(append));
  $("play-form").addEventListener("submit", (event) => { event.preventDefault(); guarded(play); });
  $("play-stop-button").addEventListener("click", () => aborter && aborter.abort());
  $("play-clear").addEventListener("click", () => { transcript = []; showTranscript(); $("reply").textContent = ""; $("play-stats").textContent = ""; });
  document.querySelectorAll("input[name=mode]").forEach((radio) => radio.addEventListener("change", setMode));
  $("key-box").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem("qwen_np_api_key", $("api-key").value);
    guarded(start);
  });
}

let filterTimer = null;
const refilter = () => { clearTimeout(filterTimer); filterTimer = setTimeout(() => state.ids && guarded(showFilter), 60); };

async function start() {
  state.model = (await api("/v1/models")).data[0].id;
  state.info = await api("/explorer/model");
  const info = state.info, dims = info.dimensions;
  $("model-name").textContent = state.model;
  $("max-tokens").textContent = info.max_tokens;
  $("dims").textContent = Object.entries(info.symbols).filter(([symbol]) => !"TS".includes(symbol))
    .map(([symbol, meaning]) => `${symbol} = ${dims[symbol]} (${meaning.split(":")[0]})`).join(" · ") + " · T: the prompt's tokens";
  $("att-layer").replaceChildren(...Array.from({ length: dims.L }, (_, l) => el("option", { value: l, textContent: l })));
  $("att-head").replaceChildren(...Array.from({ length: dims.H }, (_, h) => el("option", { value: h, textContent: `${h} (KV ${Math.floor(h / info.group_size)})` })));
  $("filter-controls").replaceChildren();
  $("play-controls").replaceChildren();
  filterSettings = samplingControls($("filter-controls"), "filter", info.defaults, refilter);
  playSettings = samplingControls($("play-controls"), "play", info.defaults, null);
  $("mode-chat").disabled = !info.chat;
  $("chat-note").textContent = info.chat ? "" : "this model has no chat template: it continues text";
  $("key-box").hidden = true;
  document.querySelectorAll("a.doc[data-view]").forEach((link) => {
    const href = info.links.views[link.dataset.view];
    link.hidden = !href;
    if (href) link.href = href;
  });
  await explore();                                 // the default prompt, at once: the page opens on the model's numbers
  document.body.dataset.ready = "true";
}

document.addEventListener("DOMContentLoaded", () => { wire(); guarded(start); });
