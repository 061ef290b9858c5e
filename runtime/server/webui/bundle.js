// llama-server's UI script name: loads the page's scripts in their order
for (const src of ["/markdown.js", "/experts.js", "/app.js"]) {
  const script = document.createElement("script");
  script.src = src;
  script.async = false;
  document.head.appendChild(script);
}
