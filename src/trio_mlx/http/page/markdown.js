// A small Markdown renderer for model answers: paragraphs (a single newline is a line break),
// headings, emphasis (*em*, **strong**, ~~struck~~), inline code, fenced code blocks, lists
// (nested, ordered or not), block quotes, rules, links and bare URLs.
//
// Safety: it builds DOM nodes and puts the model's text in them as text (textContent, text
// nodes); no string of the model's is ever parsed as HTML, so `<script>` or `<img onerror>` in an
// answer shows as those characters. A link is made only for http(s) and mailto URLs, and opens in
// a new tab without a referrer or an opener.
//
// It is meant to be run again on the whole text as the text grows (streaming): an unclosed fence
// renders as a code block up to the end, and an unclosed `**` stays as it is until it closes.

const FENCE = /^ {0,3}(`{3,}|~{3,})[ \t]*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^( {0,12})([-*+]|\d{1,9}[.)])([ \t]+|$)(.*)$/;
const SAFE_URL = /^(https?:\/\/|mailto:)/i;
// Sticky (matched at `lastIndex`, see matchAt) so that no rest of the text is copied per try.
const BARE_URL = /https?:\/\/[^\s<>"'`]+/iy;
const AUTOLINK = /<((?:https?:\/\/|mailto:)[^\s<>]+)>/iy;
const BACKTICKS = /`+/y;
const LINK_TARGET =
  /\(\s*<?([^\s<>()]*(?:\([^\s()]*\)[^\s<>()]*)*)>?(?:\s+(?:"[^"]*"|'[^']*'))?\s*\)/y;
// The longest link label looked for (so that unclosed `[`s cost little).
const LINK_LABEL_LIMIT = 1000;
const PUNCTUATION = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~";

/** The Markdown `text` rendered as a DocumentFragment of `doc`. */
export function renderMarkdown(text, doc = document) {
  const fragment = doc.createDocumentFragment();
  renderBlocks(String(text).replace(/\r\n?/g, "\n").split("\n"), fragment, doc);
  return fragment;
}

function isBlank(line) {
  return line.trim() === "";
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    ITEM.test(line);
}

function renderBlocks(lines, parent, doc) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (isBlank(line)) {
      i += 1;
      continue;
    }
    const fence = FENCE.exec(line);
    if (fence) {
      i = renderFence(lines, i, fence, parent, doc);
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      const h = doc.createElement(`h${heading[1].length}`);
      renderInline(heading[2], h, doc);
      parent.append(h);
      i += 1;
      continue;
    }
    if (RULE.test(line)) {
      parent.append(doc.createElement("hr"));
      i += 1;
      continue;
    }
    if (QUOTE.test(line)) {
      const quoted = [];
      while (i < lines.length && QUOTE.test(lines[i])) {
        quoted.push(lines[i].replace(QUOTE, ""));
        i += 1;
      }
      const quote = doc.createElement("blockquote");
      renderBlocks(quoted, quote, doc);
      parent.append(quote);
      continue;
    }
    if (ITEM.test(line)) {
      i = renderList(lines, i, parent, doc);
      continue;
    }
    const paragraph = [];
    while (i < lines.length && !isBlank(lines[i]) && (paragraph.length === 0 || !startsBlock(lines[i]))) {
      paragraph.push(lines[i].trim());
      i += 1;
    }
    const p = doc.createElement("p");
    renderInline(paragraph.join("\n"), p, doc);
    parent.append(p);
  }
}

function renderFence(lines, start, fence, parent, doc) {
  const marker = fence[1];
  const closing = new RegExp(`^ {0,3}${marker[0] === "`" ? "`" : "~"}{${marker.length},}[ \\t]*$`);
  const body = [];
  let i = start + 1;
  while (i < lines.length && !closing.test(lines[i])) {
    body.push(lines[i]);
    i += 1;
  }
  const pre = doc.createElement("pre");
  const code = doc.createElement("code");
  const language = fence[2];
  if (language) {
    code.dataset.language = language;
    pre.dataset.language = language;
  }
  code.textContent = body.join("\n");
  pre.append(code);
  parent.append(pre);
  return i + 1; // past the closing fence (or the end)
}

function renderList(lines, start, parent, doc) {
  const first = ITEM.exec(lines[start]);
  const ordered = /\d/.test(first[2]);
  const indent = first[1].length;
  const list = doc.createElement(ordered ? "ol" : "ul");
  if (ordered) {
    const number = parseInt(first[2], 10);
    if (number !== 1) list.start = number;
  }
  let loose = false;
  const items = [];
  let i = start;
  while (i < lines.length) {
    const item = ITEM.exec(lines[i]);
    if (!item || item[1].length !== indent || /\d/.test(item[2]) !== ordered) break;
    const contentIndent = item[1].length + item[2].length + Math.max(1, Math.min(item[3].length, 4));
    const body = [item[4]];
    i += 1;
    while (i < lines.length) {
      const next = lines[i];
      if (isBlank(next)) {
        // A blank line continues the item only if an indented line follows it.
        let j = i;
        while (j < lines.length && isBlank(lines[j])) j += 1;
        if (j < lines.length && leadingSpaces(lines[j]) >= contentIndent) {
          body.push(...lines.slice(i, j).map(() => ""));
          loose = true;
          i = j;
          continue;
        }
        break;
      }
      if (leadingSpaces(next) >= contentIndent) {
        body.push(next.slice(contentIndent));
      } else if (ITEM.test(next) || startsBlock(next)) {
        break;
      } else {
        body.push(next.trim()); // a lazy continuation of the item's paragraph
      }
      i += 1;
    }
    items.push(body);
    // A blank line between two items makes the list loose.
    if (i < lines.length && isBlank(lines[i])) {
      let j = i;
      while (j < lines.length && isBlank(lines[j])) j += 1;
      const again = j < lines.length ? ITEM.exec(lines[j]) : null;
      if (again && again[1].length === indent && /\d/.test(again[2]) === ordered) {
        loose = true;
        i = j;
      }
    }
  }
  for (const body of items) {
    const li = doc.createElement("li");
    const holder = doc.createDocumentFragment();
    renderBlocks(body, holder, doc);
    if (!loose && holder.firstChild && holder.firstChild.nodeName === "P") {
      // A tight list: its items' first paragraphs are not paragraphs.
      const p = holder.firstChild;
      holder.removeChild(p);
      li.append(...p.childNodes);
    }
    li.append(holder);
    list.append(li);
  }
  parent.append(list);
  return i;
}

function leadingSpaces(line) {
  return line.length - line.replace(/^ +/, "").length;
}

/** Inline Markdown of `text` appended to `parent` (text nodes and inline elements only). */
export function renderInline(text, parent, doc = document) {
  let plain = "";
  const flush = () => {
    if (plain) {
      parent.append(doc.createTextNode(plain));
      plain = "";
    }
  };
  // The first position from which a closer was looked for and not found, by delimiter: a search
  // from a later position looks at less of the same text, so it fails too. This keeps a long
  // answer with many unmatched `*` or backticks linear.
  const misses = new Map();
  let i = 0;
  while (i < text.length) {
    const c = text[i];
    if (c === "\\" && i + 1 < text.length && PUNCTUATION.includes(text[i + 1])) {
      plain += text[i + 1];
      i += 2;
      continue;
    }
    if (c === "\n") {
      flush();
      parent.append(doc.createElement("br"));
      i += 1;
      continue;
    }
    if (c === "`") {
      const run = matchAt(BACKTICKS, text, i)[0];
      const end = searchOnce(misses, run, i, () => findRun(text, "`", run.length, i + run.length));
      if (end >= 0) {
        let inner = text.slice(i + run.length, end).replace(/\n/g, " ");
        if (inner.length > 2 && inner.startsWith(" ") && inner.endsWith(" ")) inner = inner.slice(1, -1);
        flush();
        const code = doc.createElement("code");
        code.textContent = inner;
        parent.append(code);
        i = end + run.length;
        continue;
      }
      plain += run;
      i += run.length;
      continue;
    }
    if (c === "[") {
      const link = parseLink(text, i);
      if (link) {
        flush();
        const a = safeLink(link.url, doc);
        if (a) {
          renderInline(link.label, a, doc);
          parent.append(a);
        } else {
          renderInline(link.label, parent, doc);
        }
        i = link.end;
        continue;
      }
    }
    if (c === "<") {
      const auto = matchAt(AUTOLINK, text, i);
      if (auto) {
        flush();
        const a = safeLink(auto[1], doc);
        a.textContent = auto[1];
        parent.append(a);
        i += auto[0].length;
        continue;
      }
    }
    if ((c === "h" || c === "H") && (i === 0 || /[\s(]/.test(text[i - 1]))) {
      const bare = matchAt(BARE_URL, text, i);
      if (bare) {
        const url = bare[0].replace(/[.,:;!?)\]]+$/, "");
        flush();
        const a = safeLink(url, doc);
        a.textContent = url;
        parent.append(a);
        i += url.length;
        continue;
      }
    }
    if (c === "*" || c === "_" || c === "~") {
      const span = parseEmphasis(text, i, misses);
      if (span) {
        flush();
        const element = doc.createElement(span.tag);
        renderInline(span.inner, element, doc);
        parent.append(element);
        i = span.end;
        continue;
      }
    }
    plain += c;
    i += 1;
  }
  flush();
}

// `search()` unless a search for `delimiter` from an earlier position already failed; -1 and
// null are failures, remembered at `at`.
function searchOnce(misses, delimiter, at, search) {
  if (misses.has(delimiter) && misses.get(delimiter) <= at) return delimiter[0] === "`" ? -1 : null;
  const found = search();
  if (found === -1 || found === null) misses.set(delimiter, at);
  return found;
}

// The match of the sticky regular expression `re` at `at` in `text`, or null.
function matchAt(re, text, at) {
  re.lastIndex = at;
  return re.exec(text);
}

// The index of the next run of exactly `length` `char`s at or after `from`, or -1.
function findRun(text, char, length, from) {
  let i = from;
  while (i < text.length) {
    if (text[i] !== char) {
      i += 1;
      continue;
    }
    let j = i;
    while (j < text.length && text[j] === char) j += 1;
    if (j - i === length) return i;
    i = j;
  }
  return -1;
}

// `[label](url "title")` starting at `start`: {label, url, end} or null.
function parseLink(text, start) {
  let depth = 0;
  let i = start;
  if (text.indexOf("]", start) < 0) return null;
  const limit = Math.min(text.length, start + LINK_LABEL_LIMIT);
  for (; i < limit; i += 1) {
    if (text[i] === "\\") {
      i += 1;
    } else if (text[i] === "[") {
      depth += 1;
    } else if (text[i] === "]") {
      depth -= 1;
      if (depth === 0) break;
    }
  }
  if (i >= limit || text[i + 1] !== "(") return null;
  const target = matchAt(LINK_TARGET, text, i + 1);
  if (!target) return null;
  return { label: text.slice(start + 1, i), url: target[1], end: i + 1 + target[0].length };
}

// A link element for `url`, or null when the URL's scheme is not http(s) or mailto.
function safeLink(url, doc) {
  if (!SAFE_URL.test(url)) return null;
  const a = doc.createElement("a");
  a.href = url;
  a.target = "_blank";
  a.rel = "noopener noreferrer";
  return a;
}

// Emphasis starting at `start`: {tag, inner, end} or null. `_` only at word boundaries.
function parseEmphasis(text, start, misses) {
  const c = text[start];
  const double = text[start + 1] === c;
  if (c === "~" && !double) return null;
  const marker = double ? c + c : c;
  const after = text[start + marker.length];
  if (after === undefined || /\s/.test(after) || after === c) return null;
  if (c === "_" && start > 0 && /\w/.test(text[start - 1])) return null;
  return searchOnce(misses, marker, start, () => findCloser(text, start, marker));
}

function findCloser(text, start, marker) {
  const c = marker[0];
  const double = marker.length === 2;
  let i = start + marker.length + 1;
  while (i <= text.length - marker.length) {
    if (text[i] === "\\") {
      i += 2;
      continue;
    }
    if (text[i] === "`") {
      // Code spans bind tighter than emphasis: skip over one.
      const run = matchAt(BACKTICKS, text, i)[0];
      const end = findRun(text, "`", run.length, i + run.length);
      if (end >= 0) {
        i = end + run.length;
        continue;
      }
    }
    if (text.startsWith(marker, i) && !/\s/.test(text[i - 1]) &&
        (double || text[i + 1] !== c) &&
        !(c === "_" && i + 1 < text.length && /\w/.test(text[i + marker.length]))) {
      const tag = c === "~" ? "del" : double ? "strong" : "em";
      return { tag, inner: text.slice(start + marker.length, i), end: i + marker.length };
    }
    i += 1;
  }
  return null;
}
