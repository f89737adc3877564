"""Maps the top-level folders engine/, server/, clients/ onto one import namespace specserve.*."""
from setuptools import find_packages, setup

ROOTS = {"specserve": "specserve", "specserve.engine": "engine",
         "specserve.server": "server", "specserve.clients": "clients"}

packages, package_dir = [], {}
for name, path in ROOTS.items():
    packages.append(name)
    package_dir[name] = path
    packages += [f"{name}.{sub}" for sub in find_packages(path)]

setup(packages=packages, package_dir=package_dir,
      package_data={"specserve.proto": ["*.pyi"]})
