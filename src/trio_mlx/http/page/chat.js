// The chat page: a conversation with the model over /v1/chat/completions, streamed.
//
// Each answer is one streamed request (`stream: true`, `stream_options.include_usage`) carrying
// the whole conversation, the system prompt and the sampling settings; its deltas are rendered
// as Markdown as they come (reasoning_content in a collapsed block), and its figures (time to
// first token, tokens/s, tokens, cached prompt tokens) are shown live and from its usage chunk.
// Stop (or Escape) aborts the fetch: the server sees the disconnect and aborts the generation.

import { Api, describeError, readError } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { readEvents } from "./sse.js";

const SETTINGS_STORAGE = "trio-mlx.settings";

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"),
  conversation: $("conversation"),
  empty: $("empty"),
  composer: $("composer"),
  prompt: $("prompt"),
  send: $("send"),
  stop: $("stop"),
  newChat: $("new-chat"),
  settingsToggle: $("settings-toggle"),
  settings: $("settings"),
  settingsForm: $("settings-form"),
  system: $("system"),
  temperature: $("temperature"),
  topP: $("top-p"),
  maxTokens: $("max-tokens"),
  figures: $("figures"),
  keyDialog: $("key-dialog"),
  keyForm: $("key-form"),
  keyInput: $("api-key"),
  keyMessage: $("key-message"),
};

const chat = {
  /** The conversation so far: {role, content} without the system prompt. */
  messages: [],
  model: null,
  /** The AbortController of the answer being streamed, or null. */
  controller: null,
};

const api = new Api(askKey);

// --- the API key dialog ---

let pendingKey = null;

/** The key the user types, or null; requests refused at the same time share one question. */
function askKey(message) {
  if (pendingKey) return pendingKey;
  pendingKey = new Promise((resolve) => {
    ui.keyMessage.textContent = message;
    ui.keyInput.value = "";
    const closed = () => {
      ui.keyDialog.removeEventListener("close", closed);
      const key = ui.keyInput.value.trim();
      resolve(ui.keyDialog.returnValue === "save" && key ? key : null);
    };
    ui.keyDialog.returnValue = "";
    ui.keyDialog.addEventListener("close", closed);
    ui.keyDialog.showModal();
    ui.keyInput.focus();
  }).finally(() => {
    pendingKey = null;
  });
  return pendingKey;
}

// --- settings ---

function loadSettings() {
  let saved = {};
  try {
    saved = JSON.parse(window.localStorage.getItem(SETTINGS_STORAGE) || "{}") || {};
  } catch {
    saved = {};
  }
  ui.system.value = saved.system || "";
  ui.temperature.value = saved.temperature ?? "";
  ui.topP.value = saved.top_p ?? "";
  ui.maxTokens.value = saved.max_tokens ?? "";
}

function saveSettings() {
  const values = {
    system: ui.system.value,
    temperature: ui.temperature.value,
    top_p: ui.topP.value,
    max_tokens: ui.maxTokens.value,
  };
  try {
    window.localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(values));
  } catch {
    // storage disabled: settings last as long as the page
  }
}

/** The request body for the conversation so far. Empty settings are left to the server. */
function requestBody() {
  const messages = [];
  const system = ui.system.value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...chat.messages);
  const body = {
    messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  if (chat.model) body.model = chat.model;
  const number = (input) => (input.value.trim() === "" ? null : Number(input.value));
  const temperature = number(ui.temperature);
  const topP = number(ui.topP);
  const maxTokens = number(ui.maxTokens);
  if (temperature !== null) body.temperature = temperature;
  if (topP !== null) body.top_p = topP;
  if (maxTokens !== null) body.max_tokens = maxTokens;
  return body;
}

// --- the conversation view ---

function addMessageView(role, text = "") {
  ui.empty.hidden = true;
  const article = document.createElement("article");
  article.className = `message ${role}`;
  article.dataset.role = role;
  const label = document.createElement("h2");
  label.className = "role";
  label.textContent = role === "user" ? "You" : chat.model || "Model";
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.hidden = true;
  const summary = document.createElement("summary");
  summary.textContent = "Reasoning";
  const reasoningText = document.createElement("div");
  reasoningText.className = "reasoning-text";
  reasoning.append(summary, reasoningText);
  const content = document.createElement("div");
  content.className = "content";
  const status = document.createElement("p");
  status.className = "status";
  status.hidden = true;
  article.append(label, reasoning, content, status);
  ui.conversation.append(article);
  const view = { article, reasoning, reasoningText, content, status };
  if (role === "user") {
    // The user's text is shown as typed (text, not Markdown).
    content.classList.add("plain");
    content.textContent = text;
  }
  scrollToEnd(true);
  return view;
}

function nearEnd() {
  const c = ui.conversation;
  return c.scrollHeight - c.scrollTop - c.clientHeight < 80;
}

function scrollToEnd(force = false) {
  if (force || nearEnd()) ui.conversation.scrollTop = ui.conversation.scrollHeight;
}

function renderAnswer(view, answer) {
  const follow = nearEnd();
  view.content.replaceChildren(renderMarkdown(answer.content));
  if (answer.reasoning) {
    view.reasoning.hidden = false;
    view.reasoningText.replaceChildren(renderMarkdown(answer.reasoning));
  }
  if (follow) scrollToEnd(true);
}

function showStatus(view, text, kind) {
  view.status.hidden = false;
  view.status.textContent = text;
  view.status.className = `status ${kind}`;
  if (kind === "error") view.status.setAttribute("role", "alert");
}

// --- figures ---

function setFigure(name, text) {
  ui.figures.querySelector(`[data-figure="${name}"]`).textContent = text;
}

function showFigures(answer, now) {
  const first = answer.firstTokenAt;
  setFigure("ttft", first === null ? "–" : `${Math.round(first - answer.startedAt)} ms`);
  const usage = answer.usage;
  const tokens = usage ? usage.completion_tokens : answer.deltas;
  const last = usage ? answer.lastTokenAt ?? now : now;
  let rate = "–";
  if (first !== null && tokens > 1 && last > first) {
    rate = ((tokens - 1) / ((last - first) / 1000)).toFixed(1);
  }
  setFigure("tps", usage ? rate : rate === "–" ? rate : `≈${rate}`);
  setFigure("tokens", usage ? `${usage.prompt_tokens} in, ${usage.completion_tokens} out` : `${tokens} out`);
  const cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null;
  setFigure("cached", usage ? String(cached ?? 0) : "–");
}

// --- one answer ---

function setBusy(busy) {
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
  ui.conversation.setAttribute("aria-busy", busy ? "true" : "false");
}

async function ask(text) {
  chat.messages.push({ role: "user", content: text });
  const userView = addMessageView("user", text);
  const view = addMessageView("assistant");
  view.article.dataset.state = "streaming";
  const answer = {
    content: "",
    reasoning: "",
    usage: null,
    finishReason: null,
    deltas: 0,
    startedAt: performance.now(),
    firstTokenAt: null,
    lastTokenAt: null,
  };
  const controller = new AbortController();
  chat.controller = controller;
  setBusy(true);
  showFigures(answer, answer.startedAt);
  let outcome = "done";
  let failure = null;
  let pending = false;
  const render = () => {
    pending = false;
    renderAnswer(view, answer);
    showFigures(answer, performance.now());
  };
  try {
    const response = await api.fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) {
      outcome = "error";
      failure = describeError(await readError(response));
    } else {
      for await (const event of readEvents(response.body)) {
        if (event.data === "[DONE]") break;
        const chunk = JSON.parse(event.data);
        if (chunk.error) {
          outcome = "error";
          failure = describeError({ status: 0, ...chunk.error });
          break;
        }
        if (chunk.usage) answer.usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (choice) {
          const delta = choice.delta || {};
          const piece = (delta.content || "") + (delta.reasoning_content || "");
          if (piece) {
            const now = performance.now();
            if (answer.firstTokenAt === null) answer.firstTokenAt = now;
            answer.lastTokenAt = now;
            answer.deltas += 1;
          }
          answer.content += delta.content || "";
          answer.reasoning += delta.reasoning_content || "";
          if (choice.finish_reason) answer.finishReason = choice.finish_reason;
        }
        if (!pending) {
          pending = true;
          requestAnimationFrame(render);
        }
      }
    }
  } catch (error) {
    if (error && error.name === "AbortError") {
      outcome = "stopped";
    } else {
      outcome = "error";
      failure = `Connection failed: ${error && error.message ? error.message : error}`;
    }
  } finally {
    chat.controller = null;
    setBusy(false);
  }
  renderAnswer(view, answer);
  showFigures(answer, answer.lastTokenAt ?? performance.now());
  view.article.dataset.state = outcome;
  if (outcome === "stopped") {
    showStatus(view, "Stopped.", "stopped");
  } else if (outcome === "error") {
    showStatus(view, failure, "error");
  } else if (answer.finishReason === "length") {
    showStatus(view, "Cut at the token limit (max tokens).", "note");
  }
  if (answer.content) {
    chat.messages.push({ role: "assistant", content: answer.content });
  } else if (outcome === "error") {
    // Nothing came back: the message leaves the conversation and goes back to the box.
    chat.messages.pop();
    userView.article.classList.add("unsent");
    if (!ui.prompt.value) ui.prompt.value = text;
  }
  if (!answer.content && outcome === "done") view.content.textContent = "(no text)";
  ui.prompt.focus();
}

function stop() {
  if (chat.controller) chat.controller.abort();
}

function submit() {
  const text = ui.prompt.value.trim();
  if (!text || chat.controller) return;
  ui.prompt.value = "";
  fitPrompt();
  ask(text);
}

function fitPrompt() {
  ui.prompt.style.height = "auto";
  ui.prompt.style.height = `${Math.min(ui.prompt.scrollHeight, 200)}px`;
}

function newChat() {
  stop();
  chat.messages = [];
  for (const node of ui.conversation.querySelectorAll(".message")) node.remove();
  ui.empty.hidden = false;
  for (const name of ["ttft", "tps", "tokens", "cached"]) setFigure(name, "–");
  ui.prompt.focus();
}

// --- the model's name ---

async function loadModel() {
  for (let attempt = 0; attempt < 600; attempt += 1) {
    let response;
    try {
      response = await api.fetch("/v1/models");
    } catch (error) {
      ui.model.textContent = `server unreachable (${error.message})`;
      await sleep(2000);
      continue;
    }
    if (response.ok) {
      const models = await response.json();
      chat.model = models.data && models.data.length ? models.data[0].id : null;
      ui.model.textContent = chat.model || "no model";
      ui.model.dataset.ready = "true";
      return;
    }
    const error = await readError(response);
    ui.model.textContent = describeError(error);
    if (response.status !== 503) return; // 503: still loading; try again
    await sleep(1000);
  }
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

// --- wiring ---

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  submit();
});
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    submit();
  }
});
ui.prompt.addEventListener("input", fitPrompt);
ui.stop.addEventListener("click", stop);
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && chat.controller && !ui.keyDialog.open) {
    event.preventDefault();
    stop();
  }
});
ui.newChat.addEventListener("click", newChat);
ui.settingsToggle.addEventListener("click", () => {
  const open = ui.settings.hidden;
  ui.settings.hidden = !open;
  ui.settingsToggle.setAttribute("aria-expanded", String(open));
  if (open) ui.system.focus();
});
ui.settingsForm.addEventListener("input", saveSettings);
ui.settingsForm.addEventListener("submit", (event) => event.preventDefault());

loadSettings();
ui.prompt.focus();
loadModel();
