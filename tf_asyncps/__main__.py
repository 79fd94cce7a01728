"""``python -m tf_asyncps`` == the ``tf-asyncps`` console script."""

from tf_asyncps.app.cli import run

if __name__ == "__main__":
    run()
