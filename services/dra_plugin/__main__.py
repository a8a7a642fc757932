from services.dra_plugin.service import main

main()
