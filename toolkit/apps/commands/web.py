"""onnxformer web: a bundle as a web page that runs it in the browser (onnxruntime-web, WASM), and serving it."""

import click

from toolkit.apps.commands._common import friendly


@click.command("web")
@click.argument("path", type=click.Path())
@click.option("--out", type=click.Path(), help="the site folder to write (from a BUNDLE)")
@click.option("--force", is_flag=True, help="replace a site onnxformer web wrote at --out")
@click.option("--webgpu", is_flag=True, help="add onnxruntime-web's WebGPU build (open the page with ?ep=webgpu)")
@click.option("--serve", "serve", is_flag=True, help="serve the site PATH on 127.0.0.1 (COOP/COEP headers)")
@click.option("--port", type=int, default=8000, show_default=True, help="the port --serve listens on")
@friendly
def command(path, out, force, webgpu, serve, port):
    """Write a static site that runs BUNDLE in the browser (onnxformer web BUNDLE --out SITE), or serve one
    (onnxformer web SITE --serve)."""
    from runtime.errors import InputError
    from toolkit.apps.web.site import site_server, write_site

    if serve:
        if out:
            raise InputError("--serve serves a site that exists; drop --out (or write it first without --serve)")
        server = site_server(path, port)
        click.echo(f"serving {path} at http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C stops)")
        try:
            server.serve_forever()
        finally:
            server.server_close()
        return
    if not out:
        raise InputError("pass --out SITE, the folder to write the page into (or --serve to serve a site)")
    site = write_site(path, out, force, webgpu=webgpu)
    click.echo(f"wrote {site}; serve it with: onnxformer web {site} --serve"
               + (" (WebGPU: open it with ?ep=webgpu)" if webgpu else ""))
