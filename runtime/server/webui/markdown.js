// The chat page's markdown renderer: renderMarkdown(text) -> HTML string.
//
// Blocks: fenced code (``` or ~~~, an unclosed fence runs to the end so a streaming answer
// renders as it comes), headings, paragraphs, block quotes, lists (nested by indentation),
// tables, rules. Inline: code spans, links, bare http(s) links, bold, italic, strikethrough.
//
// Safety, the invariant: every character of the source reaches the output through escapeHtml
// (code, text, link labels and targets alike); the only tags and attributes in the output are
// the ones written below; a link keeps its target only for http(s) and mailto, else it renders
// as its label. So no markup the model writes becomes markup in the page.
"use strict";
(function (global) {
  const ESC = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
  const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ESC[c]);
  const MAX_DEPTH = 16;       // nested quotes and lists beyond this render as plain paragraphs

  // [label](target "title"): the label may hold code placeholders, the target balanced
  // parentheses one deep
  const LINK = new RegExp("\\[([^\\]\u0000]*(?:\u0000\\d+\u0000[^\\]\u0000]*)*)\\]"
    + "\\(\\s*((?:[^\\s()]|\\([^\\s()]*\\))+)(?:\\s+&quot;.*?&quot;)?\\s*\\)", "g");

  // ---- inline ------------------------------------------------------------------------------
  // Code spans and links are set aside as \u0000N\u0000 placeholders (the source's own \u0000
  // are dropped first), so that emphasis never reaches into them.
  function inline(text) {
    const stash = [];
    const keep = (html) => "\u0000" + (stash.push(html) - 1) + "\u0000";
    let s = text.replace(/\u0000/g, "");
    s = s.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g,
                  (m, ticks, code) => keep("<code>" + escapeHtml(code) + "</code>"));
    s = escapeHtml(s);
    // target and title are already escaped (no quote survives)
    s = s.replace(LINK,
                  (m, label, target) => /^(https?:\/\/|mailto:)/i.test(target)
                    ? keep('<a href="' + target + '" target="_blank" rel="noopener noreferrer">'
                           + emphasis(label) + "</a>")
                    : label);
    // bare links; an escaped entity (&lt; &gt; &quot; &#39;) ends one, trailing punctuation
    // stays outside
    s = s.replace(/https?:\/\/(?:(?!&(?:lt|gt|quot|#39);)[^\s\u0000])+/g, (url) => {
      const tail = url.match(/[.,;:!?)\]]+$/);
      const href = tail ? url.slice(0, -tail[0].length) : url;
      return keep('<a href="' + href + '" target="_blank" rel="noopener noreferrer">' + href
                  + "</a>") + (tail ? tail[0] : "");
    });
    s = emphasis(s);
    for (let i = 0; i < 4 && s.includes("\u0000"); i++)    // a link's label holds code spans
      s = s.replace(/\u0000(\d+)\u0000/g, (m, n) => stash[+n]);
    return s;
  }

  function emphasis(s) {
    return s
      .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
      .replace(/(^|[^*\w])\*(?=[^\s*])([^*]*?[^\s*])\*(?!\*)/g, "$1<em>$2</em>")
      .replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>")
      .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
  }

  // ---- blocks ------------------------------------------------------------------------------
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

  function isBlockStart(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line)
      || ITEM.test(line);
  }

  function cells(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
  }

  function table(head, sep, rows) {
    const align = cells(sep).map((c) => c.startsWith(":") && c.endsWith(":") ? "center"
      : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "");
    const cell = (tag, text, i) => "<" + tag + (align[i] ? ' style="text-align:' + align[i]
      + '"' : "") + ">" + inline(text) + "</" + tag + ">";
    let html = "<table><thead><tr>" + cells(head).map((c, i) => cell("th", c, i)).join("")
      + "</tr></thead><tbody>";
    for (const row of rows)
      html += "<tr>" + cells(row).map((c, i) => cell("td", c, i)).join("") + "</tr>";
    return html + "</tbody></table>";
  }

  function codeBlock(lang, code) {
    const label = lang ? escapeHtml(lang) : "code";
    return '<div class="code"><div class="code-bar"><span>' + label
      + '</span><button type="button" class="copy">Copy</button></div><pre><code>'
      + escapeHtml(code) + "</code></pre></div>";
  }

  function list(lines, depth) {
    // lines: the list's lines; items start at the list's own indentation
    const first = lines[0].match(ITEM);
    const indent = first[1].length;
    const ordered = /\d/.test(first[2]);
    const items = [];
    for (const line of lines) {
      const m = line.match(ITEM);
      if (m && m[1].length <= indent + 1) items.push([m[3]]);
      else items[items.length - 1].push(line.replace(new RegExp("^ {0," + (indent + 4) + "}"), ""));
    }
    const start = ordered ? parseInt(first[2], 10) : 1;
    let html = ordered ? (start !== 1 ? '<ol start="' + start + '">' : "<ol>") : "<ul>";
    for (const item of items) {
      const body = item.join("\n");
      html += "<li>" + (item.length === 1 ? inline(body) : blocks(body, depth + 1)) + "</li>";
    }
    return html + (ordered ? "</ol>" : "</ul>");
  }

  function blocks(text, depth) {
    const lines = text.split("\n");
    let html = "";
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) { i++; continue; }
      if ((m = line.match(FENCE))) {
        const close = new RegExp("^ {0,3}" + m[1][0] + "{" + m[1].length + ",}\\s*$");
        const body = [];
        i++;
        while (i < lines.length && !close.test(lines[i])) body.push(lines[i++]);
        i++;                                     // the closing fence (or past the end)
        html += codeBlock(m[2], body.join("\n"));
        continue;
      }
      if ((m = line.match(HEADING))) {
        const n = m[1].length;
        html += "<h" + n + ">" + inline(m[2]) + "</h" + n + ">";
        i++;
        continue;
      }
      if (RULE.test(line)) { html += "<hr>"; i++; continue; }
      if (depth < MAX_DEPTH && QUOTE.test(line)) {
        const body = [];
        while (i < lines.length && lines[i].trim() && QUOTE.test(lines[i]))
          body.push(lines[i++].replace(QUOTE, ""));
        html += "<blockquote>" + blocks(body.join("\n"), depth + 1) + "</blockquote>";
        continue;
      }
      if (depth < MAX_DEPTH && ITEM.test(line)) {
        const indent = line.match(ITEM)[1].length;
        const body = [line];
        i++;
        while (i < lines.length) {
          const next = lines[i];
          if (!next.trim()) {                    // a blank line ends the list unless more follows
            const after = lines[i + 1];
            if (after !== undefined && (ITEM.test(after) || /^ {2,}\S/.test(after))) {
              i++;
              continue;
            }
            break;
          }
          const item = next.match(ITEM);
          if (item ? item[1].length < indent : (!/^ {2,}/.test(next) && isBlockStart(next)))
            break;
          body.push(next);
          i++;
        }
        html += list(body, depth);
        continue;
      }
      if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1])
          && lines[i + 1].includes("-")) {
        const head = line, sep = lines[i + 1], rows = [];
        i += 2;
        while (i < lines.length && lines[i].includes("|") && lines[i].trim()) rows.push(lines[i++]);
        html += table(head, sep, rows);
        continue;
      }
      const para = [line];
      i++;
      while (i < lines.length && lines[i].trim() && !isBlockStart(lines[i])) para.push(lines[i++]);
      html += "<p>" + inline(para.join("\n")).replace(/\n/g, "<br>") + "</p>";
    }
    return html;
  }

  global.escapeHtml = escapeHtml;
  global.renderMarkdown = (text) => blocks(String(text).replace(/\r\n?/g, "\n"), 0);
})(window);
